"""Every test runs on 8 emulated CPU devices; this is the one place that sets it up."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests expect 8 emulated CPU devices, got {jax.device_count()}"
