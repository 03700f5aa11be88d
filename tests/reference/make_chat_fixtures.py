"""Creates the chat-template fixtures under tests/fixtures/chat/ and transformers' token ids.

Run in a separate environment with transformers (never installed by `make test`):

    python3 -m venv /work/venv-lora
    /work/venv-lora/bin/pip install torch transformers peft
    /work/venv-lora/bin/python tests/reference/make_chat_fixtures.py

It trains two tiny BPE tokenizers (``tokenizers``, fixed corpus, at most 128 ids so the
tests/fixtures/hf models take them) and gives each a chat template: ``llama3`` (Llama 3's
template: header tokens, ``<|eot_id|>``, bos first) and ``chatml`` (Qwen 2.5's ChatML template
with its default system prompt; eos ``<|im_end|>`` ends every turn). ``expected.json`` holds,
for each conversation of ``chat.jsonl``, transformers' ``apply_chat_template(messages,
tokenize=False)`` text and ``tokenize=True`` ids, and ``mask``: 1 on the tokens of each
assistant turn (its content and the template's end of turn, found by searching the rendered
text, with the tokenizer's offsets).
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "chat"

CORPUS = [
    "the cat sat on the mat. the dog ran to the park.",
    "what is two plus two? two plus two is four.",
    "you are a helpful assistant. answer in one short line.",
    "hello there! how are you today? i am fine, thank you.",
    "name a colour: red, green and blue are colours.",
    "count to five: one, two, three, four, five.",
] * 4

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TOKENIZERS = {
    "llama3": dict(
        end="<|eot_id|>",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<unk>"],
        config=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                    unk_token="<unk>", chat_template=LLAMA3)),
    "chatml": dict(
        end="<|im_end|>\n",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
        config=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                    unk_token="<unk>", chat_template=CHATML)),
}

CHATS = [
    [{"role": "user", "content": "what is two plus two?"},
     {"role": "assistant", "content": "two plus two is four."}],
    [{"role": "system", "content": "answer in one short line."},
     {"role": "user", "content": "hello there!"},
     {"role": "assistant", "content": "hello! i am fine, thank you."},
     {"role": "user", "content": "name a colour"},
     {"role": "assistant", "content": "red"}],
    [{"role": "user", "content": "count to five"},
     {"role": "assistant", "content": "one, two, three, four, five."}],
    [{"role": "user", "content": "where did the cat sit?"},
     {"role": "assistant", "content": "the cat sat on the mat."},
     {"role": "user", "content": "and the dog?"},
     {"role": "assistant", "content": "the dog ran to the park."}],
]


def make_tokenizer(name: str) -> None:
    spec = TOKENIZERS[name]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = sorted(set("".join(CORPUS) + "\n?!:,.'"))
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=spec["specials"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {k: v for k, v in spec["config"].items() if v is not None}
    config.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=64,
                  clean_up_tokenization_spaces=False)
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / "chat.jsonl").open("w") as f:
        for chat in CHATS:
            f.write(json.dumps({"messages": chat}) + "\n")
    expected = {}
    for name in TOKENIZERS:
        make_tokenizer(name)
        hf = transformers.AutoTokenizer.from_pretrained(OUT / name)
        rows = []
        for chat in CHATS:
            text = hf.apply_chat_template(chat, tokenize=False)
            ids = hf.apply_chat_template(chat, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            spans, at = [], 0
            for m in chat:
                if m["role"] == "assistant":
                    piece = m["content"].strip() + TOKENIZERS[name]["end"]
                    at = text.index(piece, at)
                    spans.append((at, at + len(piece)))
                    at += len(piece)
            enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
            assert enc["input_ids"] == list(ids)
            mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
            rows.append({"text": text, "ids": [int(i) for i in ids], "mask": mask})
        expected[name] = rows
        print(name, "vocab", len(hf), "ids", [len(r["ids"]) for r in rows])
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
