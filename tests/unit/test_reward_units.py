"""Reward service pieces without a server: the allow-list, the built-in rewards, how a function is
called (by its signature) and how what it returns or raises becomes a result, finding the processes
below one, settings validation, percentiles."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from schemas.messages import RewardItem
from services.common.settings import SettingsError, load_settings
from services.reward import builtin
from services.reward.allowlist import BUILTIN_REFS, AllowList, NotAllowedError
from services.reward.calling import CallError, caller
from services.reward.proctree import descendants
from services.reward.service import item_kwargs
from services.reward.settings import RewardSettings
from services.reward.stats import percentile
from services.reward.worker import score, to_outcome


def test_allow_list_exact_module_and_package_entries() -> None:
    allow = AllowList(["a.b:f", "tests.reward_fns:*", "mypkg.*:*"])
    assert allow.check("a.b:f") == ("a.b", "f")
    assert allow.check("tests.reward_fns:sleepy") == ("tests.reward_fns", "sleepy")
    assert allow.check("mypkg.sub.deep:g") == ("mypkg.sub.deep", "g")
    for ref in ("a.b:g", "a:f", "os:system", "mypkg:g", "tests.reward_fns_evil:x"):
        with pytest.raises(NotAllowedError, match="not on this reward service's allow-list"):
            allow.check(ref)
    with pytest.raises(NotAllowedError, match="private"):
        allow.check("tests.reward_fns:_hidden")
    with pytest.raises(NotAllowedError, match="module:function"):
        allow.check("tests.reward_fns.sleepy")
    assert allow.preload_modules() == ["a.b", "tests.reward_fns"]


def test_bad_allow_list_entry_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match=r"allow-list entry 'os\.system'"):
        load_settings(RewardSettings, overrides=["allow=[os.system]"])
    with pytest.raises(SettingsError, match="item_timeout_s"):
        load_settings(RewardSettings, overrides=["item_timeout_s=500"])


def test_builtins_are_allowed_by_default_and_can_be_turned_off() -> None:
    default = load_settings(RewardSettings, overrides=["allow=[tests.reward_fns:*]"])
    for ref in (*BUILTIN_REFS, "tests.reward_fns:length"):
        default.allow_list.check(ref)
    only_tests = load_settings(RewardSettings, overrides=["allow=[tests.reward_fns:*]", "allow_builtins=false"])
    with pytest.raises(NotAllowedError):
        only_tests.allow_list.check("services.reward.builtin:copy3")


def test_copy3_and_exact_match() -> None:
    assert builtin.copy3(completion="123", answer="123") == 1.0
    assert builtin.copy3(completion="1x3", answer="123", prompt="123=") == pytest.approx(2 / 3)
    assert builtin.exact_match(completion=" yes\n", answer="yes") == 1.0
    assert builtin.exact_match(completion="yes!", answer="yes") == 0.0
    with pytest.raises(ValueError, match="no 'answer'"):
        builtin.copy3(completion="123")


def test_numeric_match_takes_the_last_number() -> None:
    assert builtin.numeric_match(completion="2 + 2 = 4, so 1,234.5", answer="1234.5") == 1.0
    assert builtin.numeric_match(completion="it is 4 apples", answer="4.0") == 1.0
    assert builtin.numeric_match(completion="4, no wait, 5", answer="4") == 0.0
    assert builtin.numeric_match(completion="no idea", answer="4") == 0.0
    assert builtin.numeric_match(completion="-3e2", answer=-300) == 1.0
    with pytest.raises(ValueError, match="not a number"):
        builtin.numeric_match(completion="4", answer="four")


def test_math_verify_checks_equivalence() -> None:
    assert builtin.math_verify(completion=r"so the answer is $\boxed{\frac{1}{2}}$", answer="0.5") == 1.0
    assert builtin.math_verify(completion=r"$\frac{2}{4}$", answer=r"\frac{1}{2}") == 1.0
    assert builtin.math_verify(completion=r"$\boxed{\sqrt 2}$", solution=r"$\sqrt{2}$") == 1.0
    assert builtin.math_verify(completion=r"$\boxed{3}$", answer="4") == 0.0
    assert builtin.math_verify(completion="I don't know", answer="4") == 0.0


def test_return_values_become_ok_or_error_never_zero() -> None:
    assert to_outcome("f:g", 0.5) == ("ok", 0.5)
    assert to_outcome("f:g", True) == ("ok", 1.0)
    assert to_outcome("f:g", np.float32(0.25)) == ("ok", 0.25)
    status, message = to_outcome("f:g", None)
    assert status == "error" and "returned NoneType" in str(message)
    status, message = to_outcome("f:g", math.nan)
    assert status == "error" and "finite" in str(message)
    status, message = score("tests.reward_fns:raises", {})
    assert status == "error" and "KeyError" in str(message) and "reward_fns.py" in str(message)
    assert score("tests.reward_fns:length", {"completion": "abcd"}) == ("ok", 4.0)


def test_item_fields_win_over_row_fields() -> None:
    item = RewardItem(prompt="<chat>123=", completion="123", completion_ids=[1, 2], data={"prompt": "123=", "answer": "123"})
    kwargs = item_kwargs(item)
    assert kwargs["prompt"] == "<chat>123=" and kwargs["answer"] == "123" and kwargs["completion_ids"] == [1, 2]


def test_percentile_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) == 0.0


ITEM = {"prompt": "q", "completion": "abc", "prompt_ids": [1], "completion_ids": [7, 8], "answer": "abc", "extra": 1}


def test_functions_are_called_by_their_signature() -> None:
    def ours(completion: str = "", **row: Any) -> Any:
        return completion, sorted(row)

    def areal(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> Any:
        return completions, sorted(data)

    def narrow(completion: str, answer: str) -> Any:
        return completion, answer

    def only_kwargs(**kw: Any) -> Any:
        return kw["completion"], kw["completions"]

    def positional(prompt: str, completion: str, /, **kw: Any) -> Any:
        return prompt, completion

    assert caller(ours)(ITEM) == ("abc", ["answer", "completion_ids", "extra", "prompt", "prompt_ids"])
    assert caller(areal)(ITEM) == ("abc", ["answer", "extra"])
    assert caller(narrow)(ITEM) == ("abc", "abc")
    assert caller(only_kwargs)(ITEM) == ("abc", "abc")
    assert caller(positional)(ITEM) == ("q", "abc")


def test_a_parameter_the_item_lacks_is_named() -> None:
    def needs_label(completion: str, label: str) -> float:
        return 0.0

    with pytest.raises(CallError, match="needs 'label'"):
        caller(needs_label)(ITEM)
    status, message = score("tests.reward_fns:only_what_it_needs", {"completion": "a"})
    assert status == "error" and "cannot be called with this item" in str(message) and "'answer'" in str(message)


def test_base_exceptions_are_errors_of_the_item() -> None:
    for fn, name in (("exits_zero", "SystemExit"), ("interrupts", "KeyboardInterrupt"), ("raises_base", "ShoutError")):
        status, message = score(f"tests.reward_fns:{fn}", {})
        assert status == "error" and name in str(message) and "reward_fns.py" in str(message)


def test_descendants_sees_grandchildren() -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 600 & wait"])
    try:
        while len(descendants(proc.pid)) < 1:  # the shell starts its sleep
            assert proc.poll() is None
        mine = descendants(os.getpid())
        assert proc.pid in mine and set(descendants(proc.pid)) < set(mine)
    finally:
        for pid in descendants(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def test_pool_settings_are_checked() -> None:
    with pytest.raises(SettingsError, match="slow_item_s"):
        load_settings(RewardSettings, overrides=["slow_item_s=0"])
    with pytest.raises(SettingsError, match="max_extra_processes"):
        load_settings(RewardSettings, overrides=["max_extra_processes=-1"])


def test_the_fork_server_preloads_only_light_modules() -> None:
    # every pool process starts from a fork server that imports these; heavy imports there are paid
    # at every service start (math_verify is imported where it is used, by `builtin_math`)
    from services.reward.procpool import FORKSERVER_PRELOAD

    heavy = ("math_verify", "sympy", "pydantic", "pydantic_settings", "structlog", "nats")
    code = f"import importlib, sys; [importlib.import_module(m) for m in {list(FORKSERVER_PRELOAD)}]"
    code += f"; print([m for m in {heavy} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
