"""SGLang versions and stop strings applied client-side: the pure functions the engine and agent use."""

from __future__ import annotations

import pytest

from schemas.sglang_protocol import (
    ProtocolError,
    check_server_version,
    cut_at_stop,
    find_stop,
    parse_server_version,
)


@pytest.mark.parametrize(("raw", "want"), [
    ("0.5.23", (0, 5, 23)), ("0.5.15.post1", (0, 5, 15)), ("v0.5.6rc0", (0, 5, 6)), ("0.4", (0, 4)),
    ("jetrl-cpu", None), (None, None), ("", None),
])
def test_server_versions_parse(raw: object, want: tuple[int, ...] | None) -> None:
    assert parse_server_version(raw) == want


def test_a_server_too_old_is_refused_naming_the_version_and_the_missing_feature() -> None:
    with pytest.raises(ProtocolError, match=r"SGLang 0\.4\.10.*>= 0\.5\.19.*weight_versions"):
        check_server_version("http://s", (0, 4, 10))
    with pytest.raises(ProtocolError, match=r"SGLang 0\.5\.18.*>= 0\.5\.19.*per-token weight versions"):
        check_server_version("http://s", (0, 5, 18))
    check_server_version("http://s", (0, 5, 19))
    check_server_version("http://s", (0, 5, 23))
    check_server_version("http://s", None)  # a router reports no version: nothing to refuse on


def test_find_stop_takes_the_earliest_end() -> None:
    assert find_stop("abc STOP def END", ["END", "STOP"]) == (8, "STOP")
    assert find_stop("xx</a>", ["</a>", "a>"]) == (6, "</a>")  # same end: the longer one
    assert find_stop("nothing", ["END"]) is None


def test_cut_at_stop_keeps_tokens_through_the_one_that_completes_the_match() -> None:
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " more"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert cut_at_stop([1, 2, 3, 4, 5, 6], ["world"], decode) == (4, "world")  # the stop spans tokens 3-4
    assert cut_at_stop([1, 2, 3, 4, 5, 6], ["lo w", "!"], decode) == (3, "lo w")
    assert cut_at_stop([1, 2, 3], ["zzz"], decode) is None
    assert cut_at_stop([], ["x"], decode) is None and cut_at_stop([1], [], decode) is None
