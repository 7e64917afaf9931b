"""The arithmetic task (`jetrl up dataset_path=task:arith`) and the rewards a real-model run uses: the
generator is seeded, its answers are right, its eval set shares no prompt with the training set, and
the built-in rewards score a model's replies to it (numeric_match) and GSM8K-style answers (math_verify)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from services.common.arith_task import TEMPLATES, make_arith_row, make_arith_rows, write_task
from services.reward import builtin


def _operands(prompt: str) -> list[int]:
    import re

    return [int(x) for x in re.findall(r"\d+", prompt)]


def test_rows_are_seeded_varied_and_their_answers_right() -> None:
    rows = make_arith_rows(400, seed=3)
    assert rows == make_arith_rows(400, seed=3) and rows != make_arith_rows(400, seed=4)
    for row in rows:
        a, b = _operands(row["prompt"])
        assert 0 <= a <= 999 and 0 <= b <= 999
        assert int(row["answer"]) == a + b, row
        assert row["prompt"].endswith("Give the final answer as a number at the end of your reply.")
    openings = {row["prompt"].split()[0] for row in rows}
    assert len(openings) == len(TEMPLATES)  # every phrasing shows up
    widths = {len(str(_operands(r["prompt"])[0])) for r in rows}
    assert widths == {1, 2, 3}


def test_subtraction_and_products_when_asked() -> None:
    rng = random.Random(0)
    for op, fn in (("-", lambda a, b: a - b), ("*", lambda a, b: a * b)):
        for i in range(50):
            row = make_arith_row(rng, i, (op,))
            a, b = _operands(row["prompt"])
            assert int(row["answer"]) == fn(a, b) >= 0, row
    with pytest.raises(ValueError, match="ops"):
        make_arith_rows(3, ops=("/",))


def test_the_task_writes_a_training_set_and_a_disjoint_eval_set(tmp_path: Path) -> None:
    train, held_out = write_task("arith", tmp_path, 500, eval_n=64)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(train_rows) == 500 and len(eval_rows) == 64
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in eval_rows}
    with pytest.raises(ValueError, match="unknown task"):
        write_task("sums", tmp_path, 5)


def test_numeric_match_scores_replies_to_the_task() -> None:
    row = make_arith_rows(1, seed=0)[0]
    a, b = _operands(row["prompt"])
    right = f"We add {a} and {b}. {a} + {b} = {a + b}.\n\nThe final answer is {a + b}."
    assert builtin.numeric_match(completion=right, **row) == 1.0
    # the last number counts: a reply that ends on a wrong number fails even if the sum appeared earlier
    assert builtin.numeric_match(completion=f"{a + b}? No: {a + b + 1}", **row) == 0.0
    assert builtin.numeric_match(completion="I cannot do arithmetic.", **row) == 0.0
    assert builtin.numeric_match(completion=f"The answer is {a + b:,}", **{**row, "answer": str(a + b)}) == 1.0


GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def test_math_verify_reads_a_gsm8k_answer_field() -> None:
    assert builtin.math_verify(completion="In May she sold 24, so 72 in all. The answer is $\\boxed{72}$.", answer=GSM8K_ANSWER) == 1.0
    assert builtin.math_verify(completion="She sold 24 clips.", answer=GSM8K_ANSWER) == 0.0
    assert builtin.math_verify(completion="The total is 1234.", answer="#### 1,234") == 1.0
    with pytest.raises(ValueError, match="cannot parse"):
        builtin.math_verify(completion="72", answer="#### ")
