"""Chat messages to one prompt: the model's own template when it ships one, else a default.

Gemma 3 270M (the default generative model) is a base model whose GGUF has no chat template.
For such models Shoal uses a plain transcript, which base models continue sensibly:

    <system text>\\n\\n            (only when there is a system or developer message)
    User: <text>\\n
    Assistant: <text>\\n
    ...
    Assistant:

and adds every turn marker of that transcript as a stop string (`DEFAULT_TEMPLATE_STOPS`), so
the model answers one turn: a base model left alone goes on writing turns for both speakers
("... Assistant: two, three, ...", "\\nUser: ..."), and the reply must end at the first new
one, on a new line or not. The cost: a reply that itself contains "User:" or "Assistant:"
ends there. A model that ships a (Jinja) template gets it rendered as Hugging Face does, with
`add_generation_prompt=True`, and no stop strings of Shoal's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.api.generation import ChatTurn

# The assembler ends a reply at the earliest stop string in it; "\nUser:" begins one
# character before "User:", so a marker on a new line is cut with its newline.
DEFAULT_TEMPLATE_STOPS = ("\nUser:", "\nAssistant:", "User:", "Assistant:")
_SPEAKER = {"user": "User", "assistant": "Assistant"}


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    extra_stops: tuple[str, ...] = ()


def render_chat(turns: list[ChatTurn], template: str | None) -> ChatPrompt:
    """The prompt for a conversation, ending where the assistant's reply begins."""
    if template:
        return ChatPrompt(_render_jinja(turns, template))
    return render_default(turns)


def render_default(turns: list[ChatTurn]) -> ChatPrompt:
    system = [t.content for t in turns if t.role in ("system", "developer") and t.content]
    lines = ["\n".join(system) + "\n"] if system else []
    lines += [f"{_SPEAKER[t.role]}: {t.content}" for t in turns if t.role in _SPEAKER]
    lines.append("Assistant:")
    return ChatPrompt("\n".join(lines), DEFAULT_TEMPLATE_STOPS)


def _render_jinja(turns: list[ChatTurn], template: str) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template).render(
        messages=[{"role": t.role, "content": t.content} for t in turns],
        add_generation_prompt=True,
        # The runtime's tokenizer adds the beginning-of-sequence token itself.
        bos_token="",
        eos_token="",
    )
