"""server/openai/pieces.py in process: what a handler's pieces count for, and ``stop`` /
``max_tokens`` applied over pieces that split a stop string anywhere."""

from __future__ import annotations

import pytest

from server.openai.pieces import Choice, Piece, read_embedding, read_piece
from server.openai.request import OpenAIError


def _run(texts: list[str], stop: tuple[str, ...] = (), max_tokens: int = 100) -> Choice:
    choice = Choice(0, stop, max_tokens)
    sent = ""
    for text in texts:
        sent += choice.add(Piece(text, 1))
        if choice.finish_reason is not None:
            break
    else:
        sent += choice.end()
    assert sent == choice.content  # what streamed is what a whole answer says
    return choice


def test_pieces_plain_text_and_json() -> None:
    assert read_piece(b"word") == Piece("word", 1)
    assert read_piece(b"") == Piece("", 0)
    assert read_piece(b'{"text": "hi", "ids": [1, 2]}') == Piece("hi", 2)
    assert read_piece(b'{"text": "a", "tokens": 3, "prompt_tokens": 7, "finish_reason": "stop"}') \
        == Piece("a", 3, 7, "stop")  # fmt: skip
    assert read_piece(b'{"other": 1}') == Piece('{"other": 1}', 1)  # not a piece: text


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_stop_string_split_anywhere_never_leaks(cut: int) -> None:
    text = "one END two"
    choice = _run([text[:cut], text[cut:]], stop=("END",))
    assert (choice.content, choice.finish_reason) == ("one ", "stop")


def test_the_first_of_several_stop_strings_wins_and_a_near_miss_is_released() -> None:
    assert _run(["a b", "c d", " e"], stop=("d", "b")).content == "a "
    near = _run(["abc EN", "D? no: ENx"], stop=("END!",))
    assert (near.content, near.finish_reason) == ("abc END? no: ENx", "stop")


def test_max_tokens_ends_with_length() -> None:
    choice = _run(["a", "b", "c", "d"], max_tokens=3)
    assert (choice.content, choice.tokens, choice.finish_reason) == ("abc", 3, "length")


def test_an_embedding_that_is_not_numbers_names_the_model() -> None:
    assert read_embedding(b"[1, 2.5]", "m") == ([1.0, 2.5], 0)
    with pytest.raises(OpenAIError) as caught:
        read_embedding(b'{"embedding": "no"}', "m")
    assert caught.value.message == (
        "the handler of model 'm' answered an embedding request with"
        ' b\'{"embedding": "no"}\', not a list of numbers or {"embedding": [...]}'
    )
