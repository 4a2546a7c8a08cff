"""The thinking target the README test regenerates with ships in tests/assets/ (helpers_thinking says why and
how to rebuild it): its files and recipe are the recorded ones, and in float64 its greedy answers to the
test's conversations are far from any tie and exercise every rule that test checks (thinking, the end of
every turn, the tool call)."""
import pytest
from helpers_thinking import check_shipped

pytestmark = pytest.mark.rounding


def test_the_shipped_thinking_target_is_its_recipe_and_answers_far_from_any_tie():
    check_shipped()
