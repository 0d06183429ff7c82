"""Chat templates found and rendered as transformers 5 does.

Where the template comes from, in transformers' order (a tokenizer loaded with
AutoTokenizer):

    1. chat_template.jinja (the "default") and additional_chat_templates/*.jinja
       (named ones) -- these files override
    2. the "chat_template" entry of tokenizer_config.json (a string, or a list of
       {"name", "template"})
    3. chat_template.json, the legacy processor file, read only when 1 and 2 give
       nothing (AutoProcessor reads it; a tokenizer alone does not)

With several templates, "tool_use" is chosen when tools are passed and it exists,
else "default". The Jinja environment is the one transformers gives templates:
sandboxed, trim_blocks + lstrip_blocks, `loopcontrols` ({% break %} /
{% continue %}), the `{% generation %}` block tag, `tojson` that keeps non-ASCII
and HTML characters as they are, and the globals `raise_exception`,
`strftime_now`, `dict` and a `namespace` that refuses underscore names.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

Templates = str | dict[str, str]


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template."""


def load_chat_template(model_dir: str | Path) -> Templates | None:
    """The folder's chat template(s) in transformers' order of precedence, or None."""
    d = Path(model_dir)
    files: dict[str, str] = {}
    if (d / "chat_template.jinja").is_file():
        files["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    from_config = _from_config_entry(_read_json(d / "tokenizer_config.json").get("chat_template"))
    if from_config is not None:
        return from_config
    return _from_config_entry(_read_json(d / "chat_template.json").get("chat_template"))


def _from_config_entry(entry: object) -> Templates | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in entry if isinstance(t, dict)}
        return named or None
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def select_template(templates: Templates, has_tools: bool) -> str:
    if isinstance(templates, str):
        return templates
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ChatTemplateError(
        f"the model has several chat templates and none is named 'default': {sorted(templates)}"
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses the
    tag only to find assistant tokens for training masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # unlike Jinja's own filter: no HTML escaping, non-ASCII kept
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names (no route to Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def compile_template(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(text)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers: keys whose value is None are dropped (templates test presence),
    and a reasoning given under any of its names is also given as `thinking` and
    `reasoning_content`."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def continue_final_message(rendered: str, final: str) -> str:
    """`rendered` cut right after the final message's content, as transformers'
    `continue_final_message=True` does, so the model continues that message instead of
    starting a new turn (the template's end-of-turn text after it is dropped)."""
    if not final.strip() or final.strip() not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat"
        )
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:  # the template kept its spacing
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]
