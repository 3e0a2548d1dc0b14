"""Tool calls in Qwen3.5's format: the request's tools checked, the grammar that forces a call
(`tool_choice` "required" or a named function), and the calls parsed back out of the text.

The format is the one Qwen3.5's chat template renders for an assistant's calls (and asks the model
to write), one block per call:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A string VALUE is the text itself; any other type is its JSON. The parser turns VALUE into the type
the tool's schema declares, so a call's `arguments` are the JSON object the tool expects.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from shardspec.server.api import ApiError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule: what a name may hold wherever it is written
SCHEMA_NOTES = ("description", "title", "examples")  # what a value's grammar leaves out of its schema
_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name and its arguments' JSON schema (an object)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # its place in the request's tools (what an error names)

    @property
    def properties(self) -> dict[str, Any]:
        props = self.parameters.get("properties")
        return props if isinstance(props, dict) else {}

    def schema_of(self, key: str) -> dict[str, Any] | None:
        schema = self.properties.get(key)
        return schema if isinstance(schema, dict) else None


def parse_tools(raw: list[Any]) -> list[Tool]:
    """The request's `tools` ([{"type": "function", "function": {name, description, parameters}}]);
    ApiError 400 naming the first bad one."""
    if len(raw) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools", "tools")
    tools = [_tool(entry, i) for i, entry in enumerate(raw)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tool names must differ; {sorted(n for n in set(names) if names.count(n) > 1)} repeat",
                       "tools")
    return tools


def _tool(entry: Any, index: int) -> Tool:
    param = f"tools[{index}]"
    if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
        raise ApiError(400, 'a tool is {"type": "function", "function": {"name": ..., "parameters": ...}}', param)
    function = entry["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ApiError(400, f"a function name is 1 to 64 letters, digits, _ or - (as OpenAI's API has it), got "
                       f"{name!r:.80}", f"{param}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    param = f"{param}.function.parameters"
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ApiError(400, "a function's parameters are a JSON schema of an object", param)
    _check_parameters(parameters, param)
    return Tool(name, parameters, index)


def _check_parameters(parameters: dict[str, Any], param: str) -> None:
    """The keywords the server reads itself (to write a forced call's grammar, to type the values it
    parses) have their JSON Schema types; the rest of a schema is llguidance's to check."""
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(key, str) for key in required):
        raise ApiError(400, "required is a list of parameter names", f"{param}.required")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ApiError(400, "properties is an object of parameter schemas", f"{param}.properties")
    for key in [*properties, *required]:
        if not key or any(c in key for c in "<>\n"):
            raise ApiError(400, f"parameter names cannot be empty or hold <, > or a newline (the tool-call format "
                           f"writes them inside <parameter=...>), got {key!r:.80}", param)
    for key, schema in properties.items():
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "a parameter's schema is an object (or a boolean)", f"{param}.properties.{key}")
        if isinstance(schema, dict):
            _check_keywords(schema, f"{param}.properties.{key}")


def _check_keywords(schema: dict[str, Any], param: str) -> None:
    kind = schema.get("type", [])
    if not isinstance(kind, str) and not (isinstance(kind, list) and all(isinstance(k, str) for k in kind)):
        raise ApiError(400, "type is a type's name or a list of them", f"{param}.type")
    if not isinstance(schema.get("enum", []), list):
        raise ApiError(400, "enum is a list of values", f"{param}.enum")
    for keyword in ("minLength", "maxLength"):
        value = schema.get(keyword, 0)
        if type(value) is not int or value < 0:
            raise ApiError(400, f"{keyword} is a non-negative integer, got {value!r:.40}", f"{param}.{keyword}")
    if schema.get("minLength", 0) > schema.get("maxLength", float("inf")):
        raise ApiError(400, "minLength exceeds maxLength", f"{param}.minLength")
    if not isinstance(schema.get("pattern", ""), str):
        raise ApiError(400, "pattern is a regular expression", f"{param}.pattern")


def chosen_tools(choice: str | dict[str, Any] | None, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """(mode, the tools a forced call may use) for `tool_choice`: "none" (no call parsed), "auto" (the
    model decides; the default with tools), "required" (a call of any tool), or a named function
    ("required" of that one alone)."""
    if choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(400, 'tool_choice is "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', "tool_choice")
        if choice == "required" and not tools:
            raise ApiError(400, 'tool_choice "required" needs tools', "tool_choice")
        return choice, tools
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, 'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    named = [t for t in tools if t.name == name]
    if not named:
        raise ApiError(400, f"tool_choice names the function {name!r:.80}, which is not among the request's tools",
                       "tool_choice")
    return "required", named


# --- the grammar of a forced call ------------------------------------------------------------------


def calls_grammar(tools: list[Tool], parallel: bool, tokens: Collection[str] = ()) -> str:
    """An llguidance Lark grammar of one call (or, `parallel`, one or more) of `tools`, each with its
    required parameters in declared order, then any of the optional ones, every value valid against
    its schema (a string's text up to its maxLength; other types through the schema's JSON).
    `tokens`: the tokenizer's added tokens, which the grammar names as tokens (<tool_call>)."""
    opening, closing = (m if m in tokens else _lit(m) for m in (CALL_OPEN, CALL_CLOSE))
    end = _lit("</function>\n")
    lines = ["%llguidance {}", "start: call" + (' ("\\n" call)*' if parallel else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        keys = _ordered_keys(tool)
        required = set(tool.parameters.get("required", []))
        parts = " ".join(f"p_{i}_{j}" + ("" if key in required else "?") for j, key in enumerate(keys))
        function = _lit(f"\n<function={tool.name}>\n")
        lines.append(f"call_{i}: {opening} {function} {parts} {end} {closing}")
        for j, key in enumerate(keys):
            try:
                lines += _parameter_rules(f"p_{i}_{j}", key, tool.schema_of(key) or {}, tool.parameters)
            except ValueError as exc:  # (a string's pattern this grammar cannot say)
                raise ApiError(400, str(exc), f"tools[{tool.index}].function.parameters.properties.{key}.pattern"
                               ) from None
    return "\n".join(lines) + "\n"


def _ordered_keys(tool: Tool) -> list[str]:
    required = list(dict.fromkeys(tool.parameters.get("required", [])))  # (parse_tools checked them)
    return required + [k for k in tool.properties if k not in required]


def _parameter_rules(rule: str, key: str, schema: dict[str, Any], root: dict[str, Any]) -> list[str]:
    opening, closing = _lit(f"<parameter={key}>\n"), _lit("\n</parameter>\n")
    if _is_plain_string(schema):
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            values = " | ".join(_lit(v) for v in schema["enum"])
            return [f"{rule}: {opening} ({values}) {closing}"]
        if isinstance(schema.get("const"), str):
            return [f"{rule}: {opening} {_lit(schema['const'])} {closing}"]
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")  # (checked by parse_tools)
        count = f"{{{low},{high}}}"
        # the text cannot hold </parameter> (the parser ends the value at the first one)
        text = f"/(?s:.){count}/ & ~/(?s:.*)<\\/parameter>(?s:.*)/"
        if isinstance(schema.get("pattern"), str):
            text = f"({text} & /{whole_value_regex(schema['pattern'])}/)"
            if isinstance(schema.get("type"), list) and "null" in schema["type"]:
                text += ' | "null"'  # (the template writes null as null: typed_value reads it back)
        return [f"{rule}: {opening} {rule.upper()}", f"{rule.upper()}: ({text}) {closing}"]
    sub = {k: v for k, v in schema.items() if k not in SCHEMA_NOTES}
    for defs in ("$defs", "definitions"):  # $refs resolve against the value's own schema
        if isinstance(root.get(defs), dict):
            sub.setdefault(defs, root[defs])
    return [f"{rule}: {opening} %json {json.dumps(sub)} {closing}"]


def whole_value_regex(pattern: str) -> str:
    """A JSON Schema `pattern` (ECMA-262) as a regex of the whole value for a grammar's /.../: the
    pattern matches anywhere in the value, each of its top-level alternatives unless a ^ at its start
    or a $ at its end anchors it (an alternative that is one group is read the same way inside);
    ECMA's ASCII \\d and \\w and its `.` (not a line terminator) spelled out, slashes escaped.
    ValueError for a ^ or $ anchor anywhere else (outside a character class), which this form
    cannot say."""
    wholes = []
    for chars in _alternatives(list(_regex_chars(pattern))):
        if (group := _group_body(chars)) is not None:  # (^a|b$) and (?:^a|b$) as ^a|b$
            wholes.append(whole_value_regex("".join(c for c, _ in group)))
            continue
        head, tail = chars[:1] == [("^", "bare")], chars[-1:] == [("$", "bare")]
        inner = chars[head : len(chars) - tail]
        if any(kind == "bare" and c in "^$" for c, kind in inner):
            raise ValueError(f"a string parameter's pattern may anchor with ^ and $ only at the ends of its "
                             f"alternatives, got {pattern!r:.80}")
        text = "".join(_ecma(c, kind) for c, kind in inner)
        wholes.append(("" if head else "(?s:.*)") + f"(?:{text})" + ("" if tail else "(?s:.*)"))
    return wholes[0] if len(wholes) == 1 else "(?:" + "|".join(wholes) + ")"


def _alternatives(chars: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """A regex's characters split at its top-level |."""
    alternatives: list[list[tuple[str, str]]] = [[]]
    depth = 0
    for c, kind in chars:
        depth += (c == "(") - (c == ")") if kind == "bare" else 0
        if (c, kind) == ("|", "bare") and depth == 0:
            alternatives.append([])
        else:
            alternatives[-1].append((c, kind))
    return alternatives


def _group_body(chars: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
    """The inside of a plain or non-capturing group that is the whole of `chars`, else None."""
    if len(chars) < 2 or chars[0] != ("(", "bare") or chars[-1] != (")", "bare"):
        return None
    depth = 0
    for i, (c, kind) in enumerate(chars):
        depth += (c == "(") - (c == ")") if kind == "bare" else 0
        if depth == 0 and i < len(chars) - 1:
            return None  # (the first group closes before the end: (a)(b))
    body = chars[1:-1]
    if body[:1] == [("?", "bare")]:
        if body[1:2] != [(":", "bare")]:
            return None  # (a lookaround or a named group: left to llguidance, which refuses what it cannot)
        body = body[2:]
    return body


def _regex_chars(pattern: str) -> Iterator[tuple[str, str]]:
    """A regex's characters, each with its kind: "escape" (a backslash that escapes the next),
    "escaped", "class" (inside a character class, its brackets included) or "bare" (where ^, $, |
    and parentheses are syntax)."""
    escaped, in_class = False, False
    for c in pattern:
        if escaped:
            escaped = False
            yield c, "escaped"
        elif c == "\\":
            escaped = True
            yield c, "escape"
        elif in_class or c == "[":
            in_class = c != "]"
            yield c, "class"
        else:
            yield c, "bare"


_ECMA_ESCAPES = {"d": "0-9", "w": "A-Za-z0-9_"}  # (ECMA's \\d and \\w are ASCII; llguidance's would be Unicode)


def _ecma(c: str, kind: str) -> str:
    """One character of an ECMA-262 regex in llguidance's syntax (an escape's backslash comes out with
    the character it escapes)."""
    if kind == "escape":
        return ""
    if kind == "escaped":
        ascii_class = _ECMA_ESCAPES.get(c.lower())
        if ascii_class is None:
            return "\\" + c
        negated = c.isupper()
        return f"[{'^' if negated else ''}{ascii_class}]"
    if (c, kind) == (".", "bare"):
        return "[^\\n\\r\\u2028\\u2029]"
    if c == "/":
        return "\\/"
    return c


def _is_plain_string(schema: dict[str, Any]) -> bool:
    """A value the format writes as bare text (the template writes any string so): a schema of type
    "string" (or of types that include it), or an enum or const of strings alone."""
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema.get("const", 0)]
    return kind is None and bool(values) and all(isinstance(v, str) for v in values)


def _lit(text: str) -> str:
    return json.dumps(text)


# --- parsing ---------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One call as it is parsed: the name and each parameter's value once its block closes."""

    name: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments: dict[str, Any] = field(default_factory=dict)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


class CallParser:
    """One `<tool_call>` block's text as it grows: `feed` returns the pieces of the call's OpenAI
    arguments string that became known (whole parameters, then the closing brace), after the call's
    name; the pieces concatenate to `json.dumps(arguments)`."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}
        self.text = ""
        self.call: ToolCall | None = None
        self.done = 0  # parameters emitted
        self.closed = False
        self.body = 0  # where the function's tag ends
        self.undeclared: int | None = None  # where the tag of a function the request did not offer ends

    def feed(self, text: str) -> Iterator[str]:
        self.text += text
        if self.closed:
            return  # (what follows the call's </function> in its block is no part of it)
        if self.call is None:
            if (match := _FUNCTION.search(self.text)) is None:
                return
            if match.group(1).strip() not in self.tools:
                self.undeclared = match.end()  # a function the request did not offer: text, not a call
                return
            self.call, self.body = ToolCall(match.group(1).strip()), match.end()
        params, end = [], self.body
        for match in _PARAMETER.finditer(self.text, self.body):  # (those before the call's </function>)
            if "</function>" in self.text[end : match.start()]:
                break
            params.append(match)
            end = match.end()
        for match in params[self.done :]:
            yield self._piece(match.group(1).strip(), match.group(2))
        self.done = len(params)
        rest = self.text[end:]
        if (opened := rest.find("<parameter=")) >= 0:  # (a parameter still open: its value may hold anything)
            rest = rest[:opened]
        if "</function>" in rest:
            yield self.close()

    def close(self) -> str:
        """The arguments' closing brace (`{}` without any); what finishes an unterminated call too."""
        if self.closed or self.call is None:
            return ""
        self.closed = True
        return "}" if self.done else "{}"

    def _piece(self, key: str, raw: str) -> str:
        assert self.call is not None
        value = typed_value(raw, self.tools[self.call.name].schema_of(key))
        self.call.arguments[key] = value
        lead = "{" if len(self.call.arguments) == 1 else ", "
        return f"{lead}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def typed_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the type its schema declares: a string as it is (less the newline the
    format puts on each side), anything else as JSON, or the text when it is not JSON."""
    text = raw.removeprefix("\n").removesuffix("\n")
    if schema is not None and _is_plain_string(schema):
        nullable = isinstance(schema.get("type"), list) and "null" in schema["type"]
        return None if nullable and text == "null" else text  # (the template writes null as null)
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):  # not JSON, or beyond Python's (an integer of 5,000 digits, deep nesting)
        return _loose(text, schema)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # (json.loads reads NaN and Infinity, which json.dumps writes back)


def _loose(text: str, schema: dict[str, Any] | None) -> Any:
    """What a model writes for a non-string value without valid JSON (True, 3.0 for an integer)."""
    kind = (schema or {}).get("type")
    stripped = text.strip()
    if kind == "boolean" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if kind in ("integer", "number"):
        try:
            number = float(stripped)
        except ValueError:
            return text
        if not math.isfinite(number):  # (no JSON for it)
            return text
        return int(number) if kind == "integer" and number.is_integer() else number
    return text
