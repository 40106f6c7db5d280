"""The sidecar's side of a round's network check (``kelastic_sidecar.netcheck``): what it
asks the launcher (the params line, by the checker's own codec), and what it decides
from each answer: its own failure (the preflight prefix the operator quarantines on),
others' (rendezvous again), a pass, and every way there is no verdict (inconclusive: the
workers start). The launcher and checker for real: ``tests/operator/local/test_netcheck_run.py``."""

from __future__ import annotations

import pytest

from kelastic import contract
from kelastic.control_messages import Check, Checked
from kelastic.netcheck import (
    Floors,
    Setting,
    Verdict,
    decode_params,
    encode_verdict,
)
from kelastic_sidecar.control import Disconnected
from kelastic_sidecar.netcheck import ANSWER_GRACE, NetworkCheck
from kelastic_sidecar.rendezvous import RendezvousInfo
from kelastic_sidecar.vocabulary import CheckOutcome

INFO = RendezvousInfo(round=4, group_rank=1, group_world_size=3,
                      participants=("job-0", "job-1", "job-2"))  # fmt: skip
SETTING = Setting(Floors(max_latency_s=0.01), timeout_s=20.0)


def _verdict(**fields: object) -> str:
    doc: dict = {"round": 4, "passed": True, "failed": {}, "inconclusive": "",
                 "latency_s": 0.0004, "bandwidth_bps": 9.1e8, "seconds": 0.3, **fields}  # fmt: skip
    return encode_verdict(Verdict(**doc))


class Launcher:
    """The control socket's two seams: what was sent, and the answer the wait returns."""

    def __init__(self, answer: Checked | Disconnected | None) -> None:
        self.answer = answer
        self.sent: list[Check] = []
        self.waited: list[tuple[int, float]] = []
        self.observed: list[CheckOutcome] = []

    def check(self) -> NetworkCheck:
        return NetworkCheck(SETTING, "job-1", self.sent.append, self._wait,
                            lambda outcome, took: self.observed.append(outcome))  # fmt: skip

    def _wait(self, round_: int, timeout: float) -> Checked | Disconnected | None:
        self.waited.append((round_, timeout))
        return self.answer


def test_the_check_asks_the_launcher_with_the_rounds_params() -> None:
    launcher = Launcher(Checked(round=4, verdict=_verdict()))
    result = launcher.check().run(INFO, ("10.0.0.7", 29511))
    assert result.outcome is CheckOutcome.PASSED and launcher.observed == [CheckOutcome.PASSED]
    assert "latency 0.40 ms, bandwidth 910.0 MB/s" in result.text
    (sent,) = launcher.sent
    params = decode_params(sent.params)
    assert (params.round, params.rank, params.world_size) == (4, 1, 3)
    assert (params.master_addr, params.master_port) == ("10.0.0.7", 29511)
    assert params.floors == SETTING.floors and params.timeout_s == 20.0
    assert sent.timeout == SETTING.deadline()
    assert launcher.waited == [(4, SETTING.deadline() + ANSWER_GRACE)]


def test_this_node_judged_bad_fails_with_the_preflight_prefix() -> None:
    why = "every pair test it was in failed: with 0: latency 210 ms"
    launcher = Launcher(Checked(round=4, verdict=_verdict(passed=False, failed={1: why})))
    result = launcher.check().run(INFO, ("10.0.0.7", 29511))
    assert result.outcome is CheckOutcome.SELF_FAILED
    assert result.text.startswith(f"{contract.PREFLIGHT_FAILED_PREFIX}job-1: network check "
                                  "of round 4: every pair test")  # fmt: skip


def test_others_judged_bad_make_this_node_rendezvous_again() -> None:
    launcher = Launcher(Checked(round=4, verdict=_verdict(passed=False, failed={2: "slow"})))
    result = launcher.check().run(INFO, ("10.0.0.7", 29511))
    assert result.outcome is CheckOutcome.PEERS_FAILED
    assert "group ranks 2 failed" in result.text


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (None, "did not answer"),
        (Disconnected(), "disconnected"),
        (Checked(round=4, error="the network check did not end within 90 s"), "did not end"),
        (Checked(round=4, verdict='{"round": 4, "passed": NaN}'), "verdict is not one"),
        (Checked(round=4, verdict="not json"), "verdict is not one"),
        (Checked(round=4, verdict=_verdict(round=3)), "a verdict of round 3, not 4"),
        (
            Checked(round=4, verdict=_verdict(passed=False, inconclusive="world 2: slow link")),
            "world 2: slow link",
        ),
    ],
)
def test_no_usable_verdict_is_inconclusive_and_the_workers_start(
    answer: Checked | Disconnected | None, words: str
) -> None:
    launcher = Launcher(answer)
    result = launcher.check().run(INFO, ("10.0.0.7", 29511))
    assert result.outcome is CheckOutcome.INCONCLUSIVE, result
    assert words in result.text and result.text.endswith("the workers start"), result.text
    assert launcher.observed == [CheckOutcome.INCONCLUSIVE]


def test_which_rounds_run_the_check() -> None:
    launcher = Launcher(Checked(round=4, verdict=_verdict()))
    check = launcher.check()
    alone = RendezvousInfo(round=4, group_rank=0, group_world_size=1, participants=("job-0",))
    assert check.applies(INFO, carried=False)
    assert not check.applies(INFO, carried=True)  # an in-process restart's workers go on
    assert not check.applies(alone, carried=False)  # nothing to test with one node
    assert check.gate(alone, ("10.0.0.7", 1), carried=False) is None and not launcher.sent
    off = NetworkCheck(None, "job-1", launcher.sent.append, lambda r, t: None)
    assert not off.applies(INFO, carried=False)


def test_an_older_launcher_is_never_asked_and_that_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A launcher whose ``hello`` did not say ``netcheck`` would ignore ``check`` (an
    unknown type to it), and the round would wait for the whole deadline: not asked."""
    launcher = Launcher(Checked(round=4, verdict=_verdict()))
    check = NetworkCheck(SETTING, "job-1", launcher.sent.append, launcher._wait,
                         launcher_checks=lambda: False)  # fmt: skip
    with caplog.at_level("WARNING", logger="kelastic_sidecar.netcheck"):
        assert check.gate(INFO, ("10.0.0.7", 1), carried=False) is None
        assert check.gate(INFO, ("10.0.0.7", 1), carried=False) is None
    assert launcher.sent == [] and launcher.waited == []
    said = [r.message for r in caplog.records if "launcher is older" in r.message]
    assert len(said) == 1, caplog.records
