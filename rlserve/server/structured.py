"""The request fields that constrain the output, mapped onto the engine's one
StructuredOutputsParams: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_*` fields, and tool calls that must happen (`tool_choice` "required" or a
named function, as vLLM does it: a JSON schema over the calls).

At most one of them may be set. Errors name the field the user sent, not the engine's name
for it: a schema that does not compile in `response_format` is reported as
`response_format.json_schema.schema`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rlserve.sampling_params import InvalidRequestError, StructuredOutputsParams
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, ToolDefinition

_NO_PARAMETERS = {"type": "object", "properties": {}}


class Constraint(NamedTuple):
    spec: StructuredOutputsParams
    param: str  # the request field it came from, as the user wrote it


def named_tool_schema(tools: list[ToolDefinition], choice: NamedToolChoice) -> dict[str, Any]:
    """The output is the named function's arguments."""
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool.function.parameters or _NO_PARAMETERS
    raise InvalidRequestError(
        f"tool_choice.function.name: {choice.function.name!r} is not one of the tools "
        f"({', '.join(repr(t.function.name) for t in tools)})", "tool_choice")


def required_tools_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """The output is a JSON array of one or more {"name", "parameters"} objects, each naming
    one of the tools with arguments its schema accepts (vLLM's schema for "required")."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise InvalidRequestError(
                    f"tools: $defs {name!r} is defined differently by two tools; with "
                    "tool_choice 'required' their definitions share one namespace", "tools")
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _sources(body: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """(field the user sent, StructuredOutputsParams arguments) for each constraint set."""
    out: list[tuple[str, dict[str, Any]]] = []
    so = body.structured_outputs
    if so is not None:
        out.append(("structured_outputs", dict(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
            json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)))
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", dict(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema: required when type is "
                                      "'json_schema'", "response_format")
        out.append(("response_format.json_schema.schema", dict(json=rf.json_schema.schema_)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            out.append((name, {kind: value}))
    if isinstance(body, ChatCompletionRequest) and body.tools:
        # Compact JSON: arguments are data for a program, and a grammar that allows any
        # whitespace lets a weak model fill max_tokens with it, leaving no call at all.
        choice = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            out.append(("tools", dict(json=named_tool_schema(body.tools, choice),
                                      disable_any_whitespace=True)))
        elif choice == "required":
            out.append(("tools", dict(json=required_tools_schema(
                body.tools, body.parallel_tool_calls is not False), disable_any_whitespace=True)))
    return out


def constraint(body: CompletionRequest | ChatCompletionRequest, compiler) -> Constraint | None:
    """The request's output constraint, checked (parsed by xgrammar: milliseconds, no token
    masks) so that a bad one is a 400 naming the user's field before anything runs.
    `compiler`: a StructuredOutputCompiler (its `validate`)."""
    sources = _sources(body)
    if not sources:
        return None
    if len(sources) > 1:
        # A tool call that must happen is what tool_choice asked for.
        a, b = ("tool_choice" if p == "tools" else p.split(".")[0] for p, _ in sources[:2])
        raise InvalidRequestError(f"{b}: cannot be combined with {a}; set one output constraint", b)
    param, kwargs = sources[0]
    try:
        spec = StructuredOutputsParams(**kwargs)
        compiler.validate(spec)
    except InvalidRequestError as e:
        raise _renamed(e, param) from None
    return Constraint(spec, param)


def as_user_field(body: CompletionRequest | ChatCompletionRequest, e: InvalidRequestError) -> InvalidRequestError:
    """The engine's refusal of a grammar (compile time, say), about the field the user sent."""
    if not (e.param or "").startswith("structured_outputs"):
        return e
    sources = _sources(body)
    return _renamed(e, sources[0][0]) if sources else e


def _renamed(e: InvalidRequestError, param: str) -> InvalidRequestError:
    """The engine's error about `structured_outputs.<kind>`, about the field the user sent."""
    message = str(e)
    if param != "structured_outputs" and e.param and message.startswith(e.param):
        message = param + message[len(e.param):]
    return InvalidRequestError(message, param.split(".")[0])
