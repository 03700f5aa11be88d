"""Where a Hugging Face tokenizer directory keeps its chat template, found as transformers does.

transformers (4.47 and later; the only way 5.x ``save_pretrained`` writes it) reads the
template from ``chat_template.jinja`` and named ones from ``additional_chat_templates/NAME.jinja``;
these files take priority over the ``chat_template`` of ``tokenizer_config.json`` (a string, or
a list of ``{"name", "template"}``). A processor's legacy ``chat_template.json``
(``{"chat_template": ...}``) is the last resort. Of named templates, ``default`` is used, as in
``apply_chat_template``. `template_files` lists the files to copy with a tokenizer so that
the copy keeps its template.

Example::

    text, source = find_template("models/qwen", tokenizer_config)
    source                                   # 'chat_template.jinja'
    template_files("models/qwen")            # ['chat_template.jinja']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardax.filecheck import MAX_JSON_BYTES, read_json, read_text

__all__ = ["find_template", "template_files"]

JINJA_FILE = "chat_template.jinja"
NAMED_DIR = "additional_chat_templates"
LEGACY_FILE = "chat_template.json"
# Released templates are a few KB (the largest some 20 KB).
MAX_TEMPLATE_BYTES = 2**20


def template_files(directory: str | Path) -> list[str]:
    """The chat template files of a tokenizer directory, relative to it (the jinja file, the
    named templates' files, the legacy JSON file), in that order.

    Example::

        template_files("models/qwen")        # ['chat_template.jinja']
    """
    d = Path(directory)
    named = sorted(p for p in (d / NAMED_DIR).glob("*.jinja")) if (d / NAMED_DIR).is_dir() \
        else []
    return [name for name in (JINJA_FILE, *(f"{NAMED_DIR}/{p.name}" for p in named),
                              LEGACY_FILE) if (d / name).is_file()]


def find_template(directory: str | Path, config: dict[str, Any]) -> tuple[str, str]:
    """``(template text, where it came from)``: the default chat template of the tokenizer in
    ``directory`` whose ``tokenizer_config.json`` holds ``config``. A ValueError names the
    file when there is none, or no 'default' among named ones, or it is not text.

    Example::

        find_template("models/llama", {"chat_template": "{{ messages }}"})
        # ('{{ messages }}', 'tokenizer_config.json')
    """
    d = Path(directory)
    files = [f for f in template_files(d) if f != LEGACY_FILE]
    if files:  # as transformers: the files replace any template of tokenizer_config.json
        named = {("default" if f == JINJA_FILE else Path(f).stem): f for f in files}
        if "default" not in named:
            raise ValueError(f"{d}: chat templates {sorted(named)} in {NAMED_DIR}/ and no "
                             f"default one ({JINJA_FILE}); add it")
        return read_text(d / named["default"], MAX_TEMPLATE_BYTES), named["default"]
    source, template = "tokenizer_config.json", config.get("chat_template")
    if template is None and (d / LEGACY_FILE).is_file():
        legacy = read_json(d / LEGACY_FILE, MAX_JSON_BYTES)
        source = LEGACY_FILE
        template = legacy.get("chat_template") if isinstance(legacy, dict) else legacy
    if template is None:
        raise ValueError(f"{d}: no chat_template ({JINJA_FILE}, or 'chat_template' in "
                         "tokenizer_config.json): chat data (records with 'messages') needs a "
                         "tokenizer with a chat template")
    if isinstance(template, (list, dict)):  # named templates
        pairs = (template.items() if isinstance(template, dict) else
                 [(t.get("name"), t.get("template")) if isinstance(t, dict) else (None, None)
                  for t in template])
        named = dict(pairs)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise ValueError(f"{d / source}: chat_template must be a string or a list of "
                             "{'name': ..., 'template': ...} strings")
        if "default" not in named:
            raise ValueError(f"{d / source}: chat templates {sorted(named)} and no 'default' "
                             "one among them")
        return named["default"], f"{source} (template 'default')"
    if not isinstance(template, str):
        raise ValueError(f"{d / source}: chat_template is a JSON {type(template).__name__}, "
                         "expected a string")
    return template, source
