"""benchmarks/leaderboard.py: the smallest budget from which a method keeps full's score at every larger budget, read
from ``attnkit eval`` tables (several protocols, several tables merged)."""

import importlib.util

from helpers import ROOT

spec = importlib.util.spec_from_file_location("leaderboard", ROOT / "benchmarks" / "leaderboard.py")
leaderboard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(leaderboard)

TABLE = """# a header line

task      length  protocol                 full          a@0.1            a@0.5              b@0.1              b@0.5
--------  ------  --------------  -------------  -------------  ---------------  -----------------  -----------------
passkey     2048  query-aware     100% [84-100]  10% [3-30] (0.10x)  95% [76-99] (0.95x~)  100% [84-100] (1.00x~)  90% [70-97] (0.90x~)
passkey     2048  query-agnostic  100% [84-100]  10% [3-30] (0.10x)  50% [30-70] (0.50x)  100% [84-100] (1.00x~)  40% [22-61] (0.40x)
code        2048  query-aware     49% [42-56]  52% [44-59] (1.06x)  36% [25-46] (0.74x)  49% [42-56] (1.00x~)  49% [42-56] (1.00x~)

model: tiny
"""


def test_the_smallest_budget_keeping_full_at_it_and_above():
    table = leaderboard.read_table(TABLE)
    assert set(table) == {("passkey", "query-aware"), ("passkey", "query-agnostic"), ("code", "query-aware")}
    aware = leaderboard.leaderboard([table]).split("query-agnostic")[0]
    # b keeps full at 0.1 and 0.5 on both tasks; a keeps passkey from 0.5 only, and code at 0.1 (above full) but not
    # at 0.5: no budget keeps it at and above
    assert "| b | 0.1 | 0.1 |" in aware and "| a | 0.5 | - |" in aware
    assert aware.index("| b |") < aware.index("| a |")  # ranked by the mean of the cells
    agnostic = leaderboard.leaderboard([table]).split("query-agnostic")[1]
    assert "| a | - |" in agnostic and "| b | - |" in agnostic


def test_tables_merge_and_the_first_cell_wins():
    first = leaderboard.read_table(TABLE)
    later = leaderboard.read_table(TABLE.replace("a@", "c@"))
    merged = leaderboard.leaderboard([first, later])
    assert "| c | 0.5 | - |" in merged and merged.count("| a |") == 2  # once per protocol


def test_reads_the_committed_sweep_table():
    """The text ``attnkit eval --sweep`` printed for docs/benchmarks.md: KVzip keeps every task from 0.1, KNorm none."""
    board = leaderboard.leaderboard([leaderboard.read_table(
        (ROOT / "docs" / "results" / "eviction_budgets_tiny_v2.txt").read_text())])
    assert "| kvzip | 0.1 | 0.1 | 0.1 | 0.1 |" in board and "| knorm | - | - | - | - |" in board


def test_a_task_not_run_and_a_method_without_a_budget():
    """A sweep cut short leaves ``-`` cells: ``n/r`` there, ranked on what ran; a method without a budget is ``all``
    where it keeps full's score."""
    text = """task      length             full          a@0.1            a@0.5              lazy
--------  ------  -------------  -------------  ---------------  -----------------
passkey     2048  100% [84-100]  95% [76-99] (0.95x~)  100% [84-100] (1.00x~)  100% [84-100] (1.00x~)
code        2048  49% [42-56]  -  -  30% [20-40] (0.61x)
"""
    board = leaderboard.leaderboard([leaderboard.read_table(text)])
    assert "| a | 0.1 | n/r |" in board and "| lazy | all | - |" in board
    assert board.index("| a |") < board.index("| lazy |")  # a: 0.1 on what ran; lazy: (1 + 1) / 2
