"""Tool calls on the chat endpoint: which calls a body allows, the prompt and the constraint
that make the model answer with one, and the answer read back (whole, or as a stream).

    tool_choice {"type": "function", "function": {"name": N}}, or "required" with one tool:
        the output is N's arguments alone, constrained by its `parameters` (JSON schema); the
        prompt is the messages as they are
    tool_choice "required" with several tools, or "auto" (also: tools given, tool_choice left
        out): the tools are put into the prompt, and the output is constrained by a grammar
        (Lark, `tool_grammar`) to one call in the Hermes format vLLM's hermes parser reads,

            <tool_call>
            {"name": "N", "arguments": ARGUMENTS}
            </tool_call>

        with N one of the tools and ARGUMENTS valid under N's `parameters`; "auto" also allows
        free text that does not start with "<tool_call>" (after optional whitespace)
    tool_choice "none" (or no tools): no call, the prompt as it is

The output is the target restricted to what the grammar allows, exactly as for any other
constraint: nothing is rewritten after the fact. `CallReader` reads the text as it comes: a
call is answered as `tool_calls` (its arguments the generated text, verbatim) with
finish_reason "tool_calls", free text as `content`. Streamed, the chunks are OpenAI's: the
first carries the call's id and name (once the text has named the function), the next ones
the arguments as they are generated; with "auto", nothing is sent until the text has either
started a call or cannot start one.

The prompt with tools: when the chat template renders `tools=` into a prompt that shows the
"<tool_call>" format (Qwen 2.5, Hermes), the template's rendering; otherwise (SmolLM2's and
the test pair's templates ignore tools; a template with another call format) `tools_text` in
the system message (a "system: ..." line first when there is no chat template).

Markers that the tokenizer holds as tokens of their own (Qwen 2.5, Hermes: `special_markers`)
are those tokens in the grammar, named by id, and shown in the answer's text.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

from ..constraints import Constraint, Grammar, JsonSchema
from ..constraints.spec import JSON_OPTIONS
from .protocol import ChatResponseMessage, ServeError

MARKER = "<tool_call>"
END_MARKER = "</tool_call>"
OPEN = MARKER + "\n"
CLOSE = "}\n" + END_MARKER  # the end of the call's object, then the closing tag


@dataclass(frozen=True)
class ToolPlan:
    """The calls a chat body allows: `functions` ({"name", "parameters", ...} each);
    `named`: the output is the arguments of functions[0] alone; `free_text`: "auto";
    `special`: the call markers that are special tokens of the tokenizer (`special_markers`)."""

    functions: tuple[dict, ...]
    named: bool = False
    free_text: bool = False
    special: tuple[tuple[str, int], ...] = ()

    def constraint(self) -> Constraint:
        """The constraint of the output; ValueError for parameters that are not a schema."""
        if self.named:
            fn = self.functions[0]
            return JsonSchema(fn.get("parameters") or {"type": "object"}, fn["name"])
        return Grammar(tool_grammar(self.functions, self.free_text, dict(self.special)))

    @property
    def special_text(self) -> dict[int, str]:
        """The special tokens the answer's text shows (a call's markers): {id: text}, for
        `treespec.output.TextStream`; the text of other special tokens is left out."""
        return {} if self.named else {i: text for text, i in self.special}

    def prompt(self, srv, body):
        """The prompt of a chat body with the tools in it (`srv`: the app's Server)."""
        prompt = srv.chat_prompt(body)
        if self.named:
            return prompt
        text = tools_text(self.functions, required=not self.free_text)
        if isinstance(prompt, str):  # no chat template: "role: content" lines
            return f"system: {text}\n" + prompt
        ids = template_with_tools(srv.tokenizer, prompt, self.functions)
        if ids is not None:
            return ids
        if prompt[0]["role"] == "system":
            return [{"role": "system", "content": prompt[0]["content"] + "\n\n" + text}, *prompt[1:]]
        return [{"role": "system", "content": text}, *prompt]

    def reader(self) -> CallReader:
        return CallReader(self)

    def answer(self, text: str, finish: str) -> tuple[ChatResponseMessage, str]:
        """The message of a whole answer and its finish_reason (as the stream gives them)."""
        reader = self.reader()
        deltas = reader.start() + reader.feed(text)
        rest, finish = reader.finish(finish)
        content, calls = None, None
        for d in deltas + rest:
            if "content" in d:
                content = (content or "") + d["content"]
            for call in d.get("tool_calls", ()):
                if calls is None:
                    calls = [call]
                else:
                    calls[0]["function"]["arguments"] += call["function"]["arguments"]
        return ChatResponseMessage(content=content, tool_calls=calls), finish


def tool_plan(tools, tool_choice, tokenizer=None) -> ToolPlan | None:
    """The calls a chat body allows; None: none ("none", or no tools). ServeError 400 for
    tools that are not functions, and a tool_choice that names none of them. `tokenizer`: the
    served model's, whose special call markers the calls use (`special_markers`)."""
    plan = _plan(tools, tool_choice)
    if plan is None or tokenizer is None:
        return plan
    return dataclasses.replace(plan, special=special_markers(tokenizer))


def _plan(tools, tool_choice) -> ToolPlan | None:
    if tool_choice == "none":
        return None
    if not tools:
        if tool_choice is None:
            return None
        raise ServeError(400, "tool_choice needs tools: give the functions in tools", param="tool_choice")
    functions = functions_of(tools)
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or name not in functions:
            raise ServeError(
                400, f"tool_choice names {name!r}, which is not among tools", param="tool_choice"
            )
        return ToolPlan((functions[name],), named=True)
    if tool_choice == "required":
        return ToolPlan(tuple(functions.values()), named=len(functions) == 1)
    if tool_choice in (None, "auto"):
        return ToolPlan(tuple(functions.values()), free_text=True)
    raise ServeError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or name a function "
        f"({{'type': 'function', 'function': {{'name': ...}}}}), got {tool_choice!r}",
        param="tool_choice",
    )


def functions_of(tools) -> dict[str, dict]:
    """The functions of `tools`, by name; ServeError 400 for one that is not
    {"type": "function", "function": {"name", ...}}, or a name given twice."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(fn, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise ServeError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}",
                             param=f"tools[{i}]")  # fmt: skip
        if fn["name"] in functions:
            raise ServeError(400, f"tools[{i}]: a second function named {fn['name']!r}", param=f"tools[{i}]")
        functions[fn["name"]] = fn
    return functions


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments."""
    return OPEN + '{"name": ' + json.dumps(name) + ', "arguments": '


def special_markers(tokenizer) -> tuple[tuple[str, int], ...]:
    """The call markers ("<tool_call>", "</tool_call>") that `tokenizer` holds as added tokens
    of their own (Qwen 2.5's and Hermes' do), with their ids. The tokenizer writes a marker in
    any text as that one token, and the grammar engine reads an added token as a special one,
    never as the marker's text: the grammar names it by id (`tool_grammar`)."""
    get = getattr(tokenizer, "get_added_vocab", None)
    added = get() if callable(get) else {}
    return tuple((text, added[text]) for text in (MARKER, END_MARKER) if text in added)


def tool_grammar(functions, free_text: bool, special: dict[str, int] | None = None) -> str:
    """The Lark grammar of one call of one of `functions` (or, `free_text`, of any text that
    does not start with the call marker after optional whitespace). A marker in `special`
    (text -> id) is that special token (`<[id]>`), not its spelling in text."""
    special = special or {}

    def text(s: str) -> str:
        """`s` as Lark items: string literals, and special tokens for the markers in it."""
        for marker, i in special.items():
            if marker in s:
                before, after = s.split(marker, 1)
                return " ".join(x for x in (text(before), f"<[{i}]>", text(after)) if x)
        return json.dumps(s) if s else ""  # a JSON string is a Lark string literal

    branches = (["TEXT"] if free_text else []) + [f"call_{i}" for i in range(len(functions))]
    lines = ["start: " + " | ".join(branches)]
    if free_text:
        lines.append(r"TEXT: /(?s:.*)/ & ~/(?s:\s*<tool_call>.*)/")
    for i, fn in enumerate(functions):
        schema = fn.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict):
            raise ValueError(f"{fn['name']}'s parameters must be a JSON schema object, got {schema!r}")
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        lines.append(f"call_{i}: {text(call_prefix(fn['name']))} %json {json.dumps(schema)} {text(CLOSE)}")
    return "\n".join(lines) + "\n"


def tools_text(functions, required: bool) -> str:
    """The system text that shows the model the tools and the call format."""
    signatures = "\n".join(
        json.dumps({"type": "function", "function": fn}, ensure_ascii=False) for fn in functions
    )
    first = "You must call one of these functions" if required else "You may call one of these functions"
    text = (
        f"# Tools\n\n{first}. Their signatures are within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with only a JSON object with its name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    return text if required else text + "\nOtherwise, answer in plain text."


def template_with_tools(tokenizer, messages: list[dict], functions) -> tuple[int, ...] | None:
    """The chat rendered by the template with `tools=` (token ids, as `treespec.request.chat_ids`
    makes them), when it shows the "<tool_call>" format; None when the template ignores tools
    or shows another format."""
    tools = [{"type": "function", "function": fn} for fn in functions]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that cannot take tools: the system text
        return None
    try:
        plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - one that needs tools renders them
        plain = None
    if not isinstance(text, str) or text == plain or MARKER not in text:
        return None
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


class CallReader:
    """Reads the text of an answer as it comes, as OpenAI's chat deltas (dicts): content, or
    one tool call; the first delta carries the role, and no other. Only the text decides,
    never how it was cut into pieces."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.id = "call_" + uuid.uuid4().hex[:24]
        self.prefixes = {fn["name"]: call_prefix(fn["name"]) for fn in plan.functions}
        self.close = "" if plan.named else CLOSE
        self.mode = "args" if plan.named else "undecided"  # then "name", "args" or "content"
        self.held = ""  # text read and not yet given out
        self.arguments = ""  # the arguments given out
        self.role_given = False

    def delta(self, **fields) -> dict:
        """A delta, with the role if it is the first."""
        if not self.role_given:
            self.role_given = True
            return {"role": "assistant", **fields}
        return fields

    def header(self, name: str) -> dict:
        call = {"index": 0, "id": self.id, "type": "function", "function": {"name": name, "arguments": ""}}
        return self.delta(tool_calls=[call])

    def start(self) -> list[dict]:
        """The first deltas: the call's header when the function is known from the start."""
        return [self.header(self.plan.functions[0]["name"])] if self.plan.named else []

    def feed(self, text: str) -> list[dict]:
        self.held += text
        out = []
        if self.mode == "undecided":
            if self.held.startswith(MARKER):
                self.mode = "name"
            elif not MARKER.startswith(self.held):
                self.mode = "content"
        if self.mode == "name":
            name = next((n for n, p in self.prefixes.items() if self.held.startswith(p)), None)
            if name is not None:
                self.held = self.held[len(self.prefixes[name]) :]
                self.mode = "args"
                out.append(self.header(name))
        if self.mode == "content" and (self.held or not self.role_given):
            out.append(self.delta(content=self.held))
            self.held = ""
        if self.mode == "args":
            # hold back what may be the start of the call's closing text
            keep = next((k for k in range(min(len(self.close), len(self.held)), 0, -1)
                         if self.held.endswith(self.close[:k])), 0)  # fmt: skip
            given, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
            if given:
                out.append(self.give(given))
        return out

    def give(self, arguments: str) -> dict:
        self.arguments += arguments
        return self.delta(tool_calls=[{"index": 0, "function": {"arguments": arguments}}])

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """The last deltas and the finish_reason, at the end of the text: "tool_calls" when a
        call is complete; a text cut short before it named a function is content."""
        if self.mode in ("undecided", "name"):
            return [self.delta(content=self.held)], reason
        if self.mode == "content":
            return [], reason
        # (a named function's text is its arguments: nothing is held)
        complete = self.held == self.close
        held, self.held = self.held, ""
        if held and not complete and not (self.close.startswith(held) and _is_json(self.arguments)):
            return [self.give(held)], reason  # cut inside the arguments
        return [], "tool_calls" if complete and reason == "stop" else reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def tool_stream(events, reader: CallReader):
    """The chunks of a chat stream (`Server.stream`), its content read as `reader` reads it:
    the role chunk, the content chunks and the finish chunk reshaped; rounds, usage, errors and
    the end as they are."""
    try:
        async for event in events:
            for out in _reshape(event, reader):
                yield out
    finally:
        await events.aclose()


def _reshape(event, reader: CallReader) -> list:
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices:  # a round's tree, usage, an error, the end
        return [event]
    choice, base = choices[0], {k: v for k, v in event.items() if k not in ("choices", "treespec")}
    delta, logprobs, finish = choice.get("delta") or {}, choice.get("logprobs"), choice.get("finish_reason")
    if "role" in delta:
        deltas = reader.start()
    elif finish is not None:
        deltas, finish = reader.finish(finish)
    else:
        deltas = reader.feed(delta.get("content") or "")

    def chunk(d: dict, **extra) -> dict:
        return {**base, "choices": [{"index": choice.get("index", 0), "delta": d, **extra}]}

    out = [chunk(d) for d in deltas]
    if logprobs is not None:  # with the round's last delta (alone when the round gave none)
        out[-1:] = [chunk(deltas[-1] if deltas else reader.delta(), logprobs=logprobs)]
    if finish is not None:
        stats = {"treespec": event["treespec"]} if "treespec" in event else {}
        out.append({**chunk({}, finish_reason=finish), **stats})
    return out
