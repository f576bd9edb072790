"""A server's error answers become the interface's error types, with what they carry."""

from __future__ import annotations

from gen_interface import GenerationError, NoReplicaServingError, RowLostError
from gen_remote.errors import error_from_answer


def _answer(name: str, **extra: object) -> dict[str, object]:
    return {"error": {"message": "replica 1 died", "code": 503, "gen_error": name, **extra}}


def test_a_lost_row_answer_is_a_row_lost_error_naming_the_rows_the_server_named():
    error = error_from_answer(503, _answer("RowLostError", rows=[1, 3]), "http://x/v1/completions")
    assert type(error) is RowLostError
    assert error.rows == (1, 3)
    assert error.retryable
    assert "replica 1 died" in str(error) and "503" in str(error)


def test_a_lost_row_answer_without_rows_still_raises_the_type():
    error = error_from_answer(503, _answer("RowLostError"), "http://x/v1/completions")
    assert type(error) is RowLostError and error.rows == ()


def test_no_replica_serving_is_raised_as_itself_and_retryable():
    error = error_from_answer(503, _answer("NoReplicaServingError"), "http://x/v1/completions")
    assert type(error) is NoReplicaServingError and error.retryable


def test_an_unnamed_503_is_a_plain_generation_error():
    error = error_from_answer(503, {"error": {"message": "full", "code": 503}}, "http://x/")
    assert type(error) is GenerationError
