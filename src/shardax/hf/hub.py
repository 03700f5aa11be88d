"""Hugging Face model names (``hf:ORG/NAME[@REVISION]``) resolved to local directories.

``hf:SPEC`` names a model directory. A ``SPEC`` that exists on the local file system is that
directory, as always; any other ``SPEC`` shaped like a Hub repository id (``ORG/NAME`` or
``NAME``, optionally ``@REVISION``: a branch, tag or commit) is fetched with
``huggingface_hub.snapshot_download`` (optional extra ``hf``), which keeps it in its cache
(``HF_HOME`` / ``HF_HUB_CACHE``), reads ``HF_TOKEN`` for gated models and, with
``HF_HUB_OFFLINE=1``, only looks in the cache. Only the files shardax reads are fetched
(JSON configs, ``*.safetensors``, the tokenizer and its chat templates).

Example::

    model_dir("hf:models/llama")                    # Path('models/llama'): it exists here
    model_dir("hf:meta-llama/Llama-3.2-1B@main")    # .../snapshots/<commit>
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

__all__ = ["HubError", "model_dir", "parse_name"]

# huggingface_hub's own rule for repository ids (validate_repo_id), plus an optional @revision.
_REPO_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


class HubError(ValueError):
    """A Hub name that cannot be resolved (not installed, not cached offline, not found)."""


def parse_name(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of a Hub name such as ``'org/name@v1'``, or None when ``spec``
    is not shaped like one.

    >>> parse_name("org/name@v1")
    ('org/name', 'v1')
    >>> parse_name("/abs/dir") is None
    True
    """
    repo_id, _, revision = spec.partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", "/")):
        return None
    if "@" in spec and not revision:
        return None
    return repo_id, revision or None


def model_dir(spec: str) -> Path:
    """The local directory of the ``hf:`` flag value ``spec`` (the ``hf:`` prefix optional):
    the path itself when it exists locally, else the Hub snapshot of the repository it names
    (see the module's doc). Raises `HubError` when a Hub name cannot be resolved, ValueError
    when ``spec`` is neither an existing path nor a Hub name (one line each, for the caller
    to put after the flag and ``spec``).

    Example::

        model_dir("hf:org/name@main")       # ~/.cache/huggingface/hub/models--org--name/...
    """
    spec = spec.removeprefix("hf:")
    local = Path(spec)
    if local.exists() or local.is_symlink():
        return local
    name = parse_name(spec)
    if name is None:
        raise ValueError("no such directory (and not a Hub name ORG/NAME[@REVISION])")
    return _snapshot(*name)


@functools.lru_cache(maxsize=16)  # the flag is checked, then used: one look-up per process
def _snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise HubError("not a local directory; to fetch it from the Hugging Face Hub, install "
                       "huggingface_hub: pip install 'shardax[hf]'") from None
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                 allow_patterns=_PATTERNS)
    except errors.RevisionNotFoundError:
        raise HubError(f"the Hub repository {repo_id} has no revision {revision!r}") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        why = "a gated model: accept its terms on huggingface.co and set HF_TOKEN" if isinstance(
            e, errors.GatedRepoError) else ("not found on the Hugging Face Hub (or private: "
                                            "set HF_TOKEN), and not a local directory")
        raise HubError(why) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        raise HubError(f"not a local directory, not in the Hugging Face cache "
                       f"({constants.HF_HUB_CACHE}), and {why}") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise HubError("cannot fetch it from the Hugging Face Hub: "
                       f"{' '.join(str(e).split())[:300]}") from None
    return Path(path)
