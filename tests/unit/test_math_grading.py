"""boxed_math on math-verify: a hand-made table of responses, references and verdicts, and the time
limit that keeps a pathological answer from stalling a rank.

Decisions the table pins down: a percentage equals its number both ways (50\\% is 50 and 0.5,
math-verify's reading; datasets store either); (1,2) is the open interval, so [1,2] is another
answer, while a tuple's order counts; floats equal exact values to 6 decimal places, no looser; the
last box wins; units, degrees, \\text{}-style wrappers and a full stop inside the box are ignored.
"""

from __future__ import annotations

import logging
import time

import pytest

from megacispo.data.math_grading import ANSWER_TIMEOUT_S, MathGrader
from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import boxed_math

# (id, response, reference, expected reward)
GRADING_TABLE: list[tuple[str, str, str, float]] = [
    # Numbers and their spellings.
    ("integer", "so \\boxed{42}", "42", 1.0),
    ("thousands-separator-response", "\\boxed{1,000}", "1000", 1.0),
    ("thousands-separator-reference", "\\boxed{1000}", "1,000", 1.0),
    ("thousands-thin-space", "\\boxed{10,\\!000}", "10000", 1.0),
    ("thousands-braced-comma", "\\boxed{1{,}234}", "1234", 1.0),
    ("decimal", "\\boxed{0.5}", "0.5", 1.0),
    ("decimal-trailing-zero", "\\boxed{0.50}", "0.5", 1.0),
    ("decimal-no-leading-zero", "\\boxed{.5}", "0.5", 1.0),
    ("slash-vs-frac", "\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("frac-vs-slash", "\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("dfrac-vs-short-frac", "\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
    ("tfrac", "\\boxed{\\tfrac34}", "3/4", 1.0),
    ("frac-vs-decimal", "\\boxed{\\frac{7}{2}}", "3.5", 1.0),
    ("decimal-vs-frac", "\\boxed{0.75}", "\\frac{3}{4}", 1.0),
    ("unreduced-frac", "\\boxed{\\frac{6}{4}}", "\\frac{3}{2}", 1.0),
    ("power", "\\boxed{2^{10}}", "1024", 1.0),
    ("power-of-ten", "\\boxed{10^3}", "1000", 1.0),
    ("sqrt-simplified", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("sqrt-rationalized", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("sqrt-of-square", "\\boxed{\\sqrt{4}}", "2", 1.0),
    ("negative", "\\boxed{-3}", "-3", 1.0),
    ("negative-frac-vs-decimal", "\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("negative-numerator", "\\boxed{\\frac{-1}{2}}", "-\\frac12", 1.0),
    ("unicode-minus", "\\boxed{\u22123}", "-3", 1.0),
    ("six-decimals-equal-a-third", "\\boxed{0.333333}", "\\frac13", 1.0),
    # Percentages.
    ("percent-vs-percent", "\\boxed{50\\%}", "50\\%", 1.0),
    ("percent-vs-its-number", "\\boxed{50\\%}", "50", 1.0),
    ("percent-vs-fraction-of-one", "\\boxed{50\\%}", "0.5", 1.0),
    ("fraction-of-one-vs-percent", "\\boxed{0.5}", "50\\%", 1.0),
    # Tuples, intervals, sets.
    ("left-right-parentheses", "\\boxed{\\left( 1, \\sqrt{2} \\right)}", "(1,\\sqrt{2})", 1.0),
    ("left-right-brackets", "\\boxed{\\left[1,2\\right]}", "[1,2]", 1.0),
    ("half-open-interval", "\\boxed{(-\\infty, 3]}", "(-\\infty,3]", 1.0),
    ("interval-union", "\\boxed{[0,1)\\cup(2,3]}", "[0,1) \\cup (2,3]", 1.0),
    ("tuple", "\\boxed{(1,2,3)}", "(1, 2, 3)", 1.0),
    ("set-order", "\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("solution-list-order", "\\boxed{3, -2}", "-2, 3", 1.0),
    ("matrix", "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
    # Wrappers, units, degrees.
    ("text-word", "\\boxed{\\text{yes}}", "yes", 1.0),
    ("textbf-number", "\\boxed{\\textbf{7}}", "7", 1.0),
    ("mathrm-number", "\\boxed{\\mathrm{7}}", "7", 1.0),
    ("text-vs-plain-word", "\\boxed{\\text{Tuesday}}", "Tuesday", 1.0),
    ("choice-letter", "\\boxed{\\text{(A)}}", "A", 1.0),
    ("degrees", "\\boxed{30^\\circ}", "30", 1.0),
    ("degrees-braced", "\\boxed{90^{\\circ}}", "90^\\circ", 1.0),
    ("unit-cm", "\\boxed{5\\text{ cm}}", "5", 1.0),
    ("unit-squared", "\\boxed{12\\text{ cm}^2}", "12", 1.0),
    ("dollars", "\\boxed{\\$1,000}", "1000", 1.0),
    # Expressions.
    ("expanded-square", "\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("commuted-product", "\\boxed{\\pi r^2}", "r^2\\pi", 1.0),
    ("assignment-vs-value", "\\boxed{x=-2}", "-2", 1.0),
    ("mixed-number", "\\boxed{3\\frac{1}{2}}", "\\frac72", 1.0),
    # Boxes.
    ("boxed-reference", "\\boxed{19}", "The solution is \\boxed{19}.", 1.0),
    ("fbox", "\\fbox{7}", "7", 1.0),
    ("space-before-brace", "\\boxed {7}", "7", 1.0),
    ("nested-braces", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("inline-math-box", "so $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("full-stop-in-box", "\\boxed{42.}", "42", 1.0),
    ("dollars-and-full-stop-in-box", "\\boxed{$42$.}", "42", 1.0),
    ("last-box-wins", "\\boxed{18} no wait \\boxed{19}", "19", 1.0),
    # Near misses: all 0.
    ("last-box-wins-wrong", "\\boxed{19} no wait \\boxed{18}", "19", 0.0),
    ("wrong-integer", "\\boxed{18}", "19", 0.0),
    ("wrong-sign-negative", "\\boxed{3}", "-3", 0.0),
    ("wrong-sign-positive", "\\boxed{-3}", "3", 0.0),
    ("half-vs-0.49", "\\boxed{0.49}", "1/2", 0.0),
    ("third-vs-0.33", "\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("pi-vs-5-decimals", "\\boxed{\\pi}", "3.14159", 0.0),
    ("sqrt3-vs-3-decimals", "\\boxed{\\sqrt{3}}", "1.732", 0.0),
    ("open-vs-closed-interval", "\\boxed{(1,2)}", "[1,2]", 0.0),
    ("open-vs-half-open-interval", "\\boxed{(-\\infty,3)}", "(-\\infty,3]", 0.0),
    ("tuple-order", "\\boxed{(1,3,2)}", "(1,2,3)", 0.0),
    ("percent-off-by-ten", "\\boxed{5\\%}", "0.5", 0.0),
    ("percent-vs-hundredth", "\\boxed{50\\%}", "0.05", 0.0),
    ("comma-vs-decimal-point", "\\boxed{1,234}", "1.234", 0.0),
    ("thousands-dropped", "\\boxed{3}", "3,000", 0.0),
    ("other-variable", "\\boxed{x^2}", "y^2", 0.0),
    ("infinity-sign", "\\boxed{\\infty}", "-\\infty", 0.0),
    ("text-other-word", "\\boxed{\\text{no}}", "yes", 0.0),
    ("other-choice-letter", "\\boxed{\\text{(B)}}", "A", 0.0),
    ("beyond-float-precision", "\\boxed{12345678901234567891}", "12345678901234567890", 0.0),
    ("no-box", "the answer is 19", "19", 0.0),
    ("unclosed-box", "\\boxed{19", "19", 0.0),
    ("empty-box", "\\boxed{}", "19", 0.0),
]


def record(answer: str) -> PromptRecord:
    return PromptRecord(prompt="What is it?", answer=answer)


@pytest.mark.parametrize(
    "response, reference, expected",
    [pytest.param(response, reference, expected, id=name) for name, response, reference, expected in GRADING_TABLE],
)
def test_boxed_math_table(response, reference, expected):
    assert boxed_math(response, record(reference)) == expected


def test_table_ids_are_unique():
    names = [name for name, *_ in GRADING_TABLE]
    assert len(set(names)) == len(names) >= 60


@pytest.mark.parametrize(
    "response",
    [
        # sympy computes 9^(9^9) inside one C bignum call: no signal stops it, only a kill.
        pytest.param("\\boxed{9^{9^{9^{9}}}}", id="power-tower"),
        pytest.param("\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(3000)) + "}", id="huge-polynomial"),
    ],
)
def test_a_pathological_answer_scores_zero_within_the_time_limit(response, caplog):
    boxed_math("\\boxed{1}", record("1"))  # the worker is up: its start-up is not the answer's time
    with caplog.at_level(logging.WARNING, logger="megacispo.data.math_grading"):
        start = time.perf_counter()
        reward = boxed_math(response, record("3"))
        elapsed = time.perf_counter() - start
    assert reward == 0.0
    assert elapsed < ANSWER_TIMEOUT_S + 1.0, f"{elapsed:.2f} s"
    assert f"took over {ANSWER_TIMEOUT_S} s" in caplog.text and "scored as not equal" in caplog.text
    assert boxed_math("\\boxed{\\frac{1}{2}}", record("0.5")) == 1.0, "a fresh worker grades the next answer"


def test_grader_replaces_a_killed_worker_and_ends_its_own():
    grader = MathGrader(timeout_s=0.5)
    try:
        assert grader.equal("2", "2")
        first = grader._process
        first.kill()
        first.wait()
        assert grader.equal("\\frac{1}{2}", "0.5"), "a dead worker is replaced before the next comparison"
        assert grader._process is not first
    finally:
        grader.close()
    assert grader._process is None and first.returncode is not None
