"""Post-training objectives (DPO/IPO, SimPO, ORPO, GRPO): their losses, rewards, batches and
train steps, and what each ``--objective`` trains with.

Builds on the train step and the resolved run (`shardax.train.step`, `shardax.train.resolve`);
the commands (`shardax.train.loop`, ...) import it, never the other way.
"""
