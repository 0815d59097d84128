"""The shell unwrapping's expansion budget: a script's variables cannot grow without bound.

Budgets here are small, so that a budget that stopped working costs kilobytes,
not the machine (test_plan_inputs puts the full-size scripts through the command
line under a memory cap)."""

from __future__ import annotations

import pytest

from sglang_dsv41.tools.plan.commands import ExpansionBudget, ShellRefused, split_script, unwrap


def _runs_sglang(words: list[str]) -> bool:
    return words[:2] == ["sglang", "serve"]


def _doubling(times: int) -> str:
    return "A=xxxxxxxxxx; " + "A=$A$A; " * times + "sglang serve --served-model-name $A"


def test_a_variable_that_doubles_itself_is_refused_past_the_budget():
    # 10 * 2**12 characters in the last word alone: past a budget of 10000
    with pytest.raises(ShellRefused, match=r"^its variables expand past 10000 characters$"):
        unwrap(["sh", "-c", _doubling(12)], {}, _runs_sglang, ExpansionBudget(10_000))


def test_a_long_value_repeated_is_refused_past_the_budget():
    script = "sglang serve --served-model-name " + '"$X"' * 20
    with pytest.raises(ShellRefused, match="expand past 10000 characters"):
        split_script(script, {"X": "x" * 600}, ExpansionBudget(10_000))


def test_one_budget_spans_the_scripts_it_is_given_to():
    budget = ExpansionBudget(10_000)
    found = unwrap(["sh", "-c", _doubling(8)], {}, _runs_sglang, budget)
    assert found.argv == ["sglang", "serve", "--served-model-name", "x" * 2560]
    assert budget.used == sum(10 * 2 ** n for n in range(1, 9)) + 2560  # the assignments, then the argument
    with pytest.raises(ShellRefused, match="expand past 10000 characters"):
        unwrap(["sh", "-c", _doubling(8)], {}, _runs_sglang, budget)


def test_a_refused_script_leaves_the_budget_to_the_next_one():
    budget = ExpansionBudget(10_000)
    with pytest.raises(ShellRefused):
        unwrap(["sh", "-c", _doubling(12)], {}, _runs_sglang, budget)
    assert budget.used == 0
    assert unwrap(["sh", "-c", _doubling(3)], {}, _runs_sglang, budget).argv[-1] == "x" * 80


def test_the_default_budget_reads_ordinary_scripts():
    found = unwrap(["bash", "-lc", 'export TP=8; exec sglang serve --tp "$TP" --served-model-name ${NAME:-m}'],
                   {}, _runs_sglang)
    assert found.argv == ["sglang", "serve", "--tp", "8", "--served-model-name", "m"]
