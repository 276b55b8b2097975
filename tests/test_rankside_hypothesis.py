"""A rank forked while the parent runs a hypothesis ``@given`` test runs its tests outside it.

The plugin's pool may (re)start a rank from inside a ``@given`` test of the
main process (a rank that timed out, restarted mid-example). Hypothesis keeps
"inside a @given test" per thread, and a forked rank's thread inherited it:
every ``@given`` test that rank ran next failed hypothesis's health check as
"nested" (seen in CI after one rank timed out). The inherited state is made
here as the fork leaves it -- the body run by the rank side while a ``@given``
is active in this thread.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from ddpctx.testing.rankside import call_test_body


def a_property_test_of_the_rank() -> None:
    assert not currently_in_test_context()

    @settings(max_examples=3, database=None)
    @given(st.integers())
    def holds(number: int) -> None:
        assert number == number

    holds()


@settings(max_examples=2, database=None, deadline=None)
@given(st.integers())
def test_a_rank_body_started_inside_a_given_test_is_a_test_of_its_own(number: int) -> None:
    assert currently_in_test_context()  # the state a rank forked here inherits
    call_test_body(a_property_test_of_the_rank, {})
    assert currently_in_test_context()  # and the parent's test goes on as it was
