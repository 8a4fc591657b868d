"""docs/reference/settings.md, generated from the one table of settings: the fields of
:class:`server.config.ServerConfig` (name, default, the comment above them), the environment
variable the loader reads for each (``MSERVE_<NAME>``) and TorchServe's ``config.properties`` key
that maps onto it (server/ts_config.py)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import tokenize
from io import StringIO
from pathlib import Path
from typing import Any

from server.config import ServerConfig, server_config
from server.config.loading import ENV_PREFIX
from server.ts_config import _GRPC_ADDRESSES, _MAPPED

# Set by the command line itself (where it started, what the properties file said): not settings
# a user writes, so not listed.
_INTERNAL = frozenset(("start_dir", "ts_properties", "ts_config_file"))


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on it."""
    out = {}
    for tok in tokenize.generate_tokens(StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _groups() -> list[tuple[str, list[tuple[str, str]]]]:
    """(the comment block above a run of fields, [(field, its own trailing comment)])."""
    source = inspect.getsource(server_config)
    comments = _comments(source)
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ServerConfig.__name__
    )
    groups: list[tuple[str, list[tuple[str, str]]]] = [("", [])]
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        if above:
            groups.append((" ".join(above), []))
        trailing = comments.get(node.end_lineno or node.lineno, "")
        if trailing.startswith("fmt:"):
            trailing = ""
        groups[-1][1].append((node.target.id, trailing))
    return [g for g in groups if g[1]]


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if value is None:
        return "*unset*"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "*none*" if not value else ", ".join(f"`{v}`" for v in value)
    if value == "":
        return '`""`'
    return f"`{value}`"


_GUIDE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
_ROW = re.compile(r"^\| `([a-z0-9_]+)` \|(?:[^|]|\\\|)*\|(?:[^|]|\\\|)*\|(.*)\|\s*$")


def guide_meanings() -> dict[str, str]:
    """The meaning column of the settings table in docs/configuration.md, for settings
    whose code carries no comment; its links made relative to this page."""
    out = {}
    for line in _GUIDE.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match and match.group(2).strip():
            text = match.group(2).strip()
            text = re.sub(r"\]\(#", "](../configuration.md#", text)
            text = re.sub(r"\]\((?!https?:|\.\./|#)", "](../", text)
            out.setdefault(match.group(1), text)
    return out


def _cell(text: str) -> str:
    """A meaning as a table cell: ``|`` escaped, and ``<`` outside code spans, so that a
    comment's ``<run_dir>`` shows instead of being taken for an HTML tag."""
    parts = re.split(r"(`+[^`]*`+)", text)
    text = "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)
    return text.replace("|", "\\|")


def torchserve_keys() -> dict[str, list[str]]:
    """Our setting -> TorchServe's config.properties keys that set it."""
    out: dict[str, list[str]] = {}
    for theirs, (ours, _convert) in _MAPPED.items():
        out.setdefault(ours, []).append(theirs)
    for ours, host_key, _host, port_key, _port in _GRPC_ADDRESSES:
        out.setdefault(ours, []).extend([host_key, port_key])
    return out


def render() -> str:
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    ts_keys = torchserve_keys()
    out = [
        "# Server settings",
        "",
        "Every setting of the server, generated at build time from the one table of settings",
        "(`ServerConfig` in `server/config/server_config.py`), so this page cannot drift from",
        "the code. A setting is given, lowest precedence first, by its default, TorchServe's",
        "`config.properties` (`--ts-config`, the key in the last column), the YAML file",
        "(`--config`, the setting's name as the key), an environment variable, or a flag.",
        "See [the configuration guide](../configuration.md) for how the layers combine.",
        "",
    ]
    out += [
        "A setting's meaning is the comment above it in the code (one above several settings",
        "is shown beside the first of them), else the configuration guide's table.",
        "",
        "| Setting | Default | Environment variable | TorchServe's key | Meaning |",
        "|---|---|---|---|---|",
    ]
    guide = guide_meanings()
    for text, names in _groups():
        for index, (name, trailing) in enumerate(names):
            if name in _INTERNAL:
                continue
            theirs = ", ".join(f"`{k}`" for k in ts_keys.get(name, [])) or "—"
            meaning = _cell(" ".join(x for x in (text if index == 0 else "", trailing) if x))
            out.append(
                f"| `{name}` | {_default(fields[name])} | `{ENV_PREFIX}{name.upper()}`"
                f" | {theirs} | {meaning or guide.get(name, '')} |"
            )
    out.append("")
    return "\n".join(out)
