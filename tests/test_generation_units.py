"""The generation request layer on its own: stop strings, UTF-8 across tokens, validation."""

from __future__ import annotations

import pytest

from shoal.api.errors import ApiError
from shoal.api.generation import ChatTurn, parse_generation_request
from shoal.protocol import Endpoint
from shoal.worker.tasks.chat_template import render_chat
from shoal.worker.tasks.text import TextAssembler


def _feed(assembler: TextAssembler, pieces: list[bytes]) -> list[str]:
    return [assembler.add(piece) for piece in pieces]


def test_stop_string_split_across_tokens_is_never_released():
    assembler = TextAssembler(["STOP"])
    released = _feed(assembler, [b"hello S", b"T", b"O", b"P and more"])
    assert "".join(released) == "hello "
    assert assembler.stopped and assembler.text == "hello "


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    assembler = TextAssembler(["STOP"])
    assert _feed(assembler, [b"a ST", b"ay"]) == ["a ", "STay"]
    assert not assembler.stopped
    assert assembler.finish() == ""


def test_earliest_of_several_stop_strings_wins():
    assembler = TextAssembler(["world", "lo"])
    assert assembler.add(b"hello world") == "hel"
    assert assembler.stopped


def test_multibyte_character_split_across_tokens():
    assembler = TextAssembler([])
    euro = "€".encode()
    assert _feed(assembler, [b"price ", euro[:1], euro[1:], b"5"]) == ["price ", "", "€", "5"]


def test_parse_completions_defaults_and_chat_content_parts():
    job = parse_generation_request(Endpoint.COMPLETIONS, b'{"model":"m","prompt":["hi"]}')
    assert job.prompt == "hi" and job.max_tokens == 16 and job.stops == []
    chat = parse_generation_request(
        Endpoint.CHAT_COMPLETIONS,
        b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},'
        b'{"type":"text","text":"b"}]}],"stop":"x","max_completion_tokens":5}',
    )
    assert chat.turns == [ChatTurn("user", "ab")]
    assert chat.stops == ["x"] and chat.max_tokens == 5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model":"m","prompt":"x","seed":"one"}', "seed"),
        (b'{"model":"m","prompt":"x","stop":[""]}', "stop"),
        (b'{"model":"m","prompt":"x","echo":true}', "echo"),
        (b'{"model":"m","prompt":""}', "prompt"),
        (b'{"model":"m"}', None),
        (b"not json", None),
    ],
)
def test_parse_errors_name_the_parameter(body, param):
    with pytest.raises(ApiError) as raised:
        parse_generation_request(Endpoint.COMPLETIONS, body)
    assert raised.value.status == 400 and raised.value.param == param


def test_default_chat_template_and_its_stop():
    prompt = render_chat(
        [ChatTurn("system", "Be brief."), ChatTurn("user", "Hi"), ChatTurn("assistant", "Hello")],
        template=None,
    )
    assert prompt.text == "Be brief.\n\nUser: Hi\nAssistant: Hello\nAssistant:"
    assert prompt.extra_stops == ("\nUser:", "\nAssistant:", "User:", "Assistant:")


@pytest.mark.parametrize(
    ("written", "reply"),
    [
        # What Gemma 3 270M writes on the plain transcript when nothing stops it.
        (
            " Count from two to three.\nAssistant: Count from four to three.",
            " Count from two to three.",
        ),
        (" 2+2 = 4\nUser: What is 2+2?\nAssistant: 2+2 = 4", " 2+2 = 4"),
        (" one, Assistant: two, three,", " one, "),
        (" one User: two", " one "),
    ],
)
def test_default_template_stops_at_any_new_turn(written, reply):
    stops = list(render_chat([ChatTurn("user", "Count")], template=None).extra_stops)
    assembler = TextAssembler(stops)
    # Three characters a token, as a model writes them: markers arrive split across tokens.
    # The scheduler ends the sequence at the stop: nothing is fed after it.
    released = ""
    for i in range(0, len(written), 3):
        released += assembler.add(written[i : i + 3].encode())
        if assembler.stopped:
            break
    assert released == reply and assembler.stopped


def test_model_chat_template_is_rendered():
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    prompt = render_chat([ChatTurn("user", "Hi")], template)
    assert prompt.text == "<user>Hi<assistant>" and prompt.extra_stops == ()
