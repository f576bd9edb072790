"""``ServerWeights``: the weights on the fleet's servers: a weight update's steps against them,
and a replacement's load and check.

An update runs on the members of its start (``ServerFleet.begin_update``): ``pause`` holds
their generation (``/pause_generation``: ``retract`` keeps the rows, ``abort`` ends them); the
new weights are then written into the staged checkpoint (``checkpoint.StagedCheckpoint``), which
no server reads before the commit; ``commit`` has every member load it
(``/update_weights_from_disk``, labelled with the new version) and then ``/continue_generation``;
``resume`` ends a dropped update (nothing reached a server: paused rows go on with the old
weights). A member that dies during the commit is dropped from it (healing); a refusal from a
live one leaves every server on its old weights, or, when others took the new ones already,
mixed weights (``MixedWeightsError``).

For the fleet's replacements: ``load`` gives one the committed weights from the staged
checkpoint, ``checksum`` is SGLang's checksum of the weights a server holds
(``/weights_checker``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gen_interface import GenerationError, InFlight, MixedWeightsError, WeightUpdateError

from gen_sglang.client import FleetClient
from gen_sglang.fleet import ServerLostError
from gen_sglang.server import SglangServer

__all__ = ["ServerWeights"]


class ServerWeights:
    """The weight steps against the servers ``client`` reaches; see the module docstring.

    Args:
        client: the requests to the fleet's servers.
        staged_dir: the staged checkpoint's directory (``StagedCheckpoint.dir``).
    """

    def __init__(self, client: FleetClient, staged_dir: Path):
        self.client = client
        self.staged_dir = staged_dir

    def pause(self, in_flight: InFlight) -> None:
        """An update starts: the fleet's members of now pause their generation, keeping their
        rows (``"keep"``) or ending them.

        Raises:
            BackendBrokenError: a server was lost (fail-stop); the update did not start.
            GenerationError: a server refused to pause; the update did not start.
        """
        mode = "retract" if in_flight == "keep" else "abort"
        fleet = self.client.fleet()
        members = fleet.begin_update()
        try:
            self.client.each_server("/pause_generation", {"mode": mode}, replicas=members)
        except BaseException:
            fleet.update_ended()  # no transaction opened: neither commit nor abort follows
            raise

    def commit(self, version: int) -> None:
        """Every member of the update loads the staged checkpoint as ``version``, and
        generation goes on. A member that dies on the way is dropped from the update
        (healing); a refusal from a live one leaves every server on its old weights, or, when
        others took the new ones already, mixed weights.

        Raises:
            WeightUpdateError: a server refused the weights and none took them, or no member
                was left to take them.
            MixedWeightsError: a server refused them after others took them.
            BackendBrokenError: a server was lost (fail-stop).
        """
        fleet = self.client.fleet()
        taken: list[str] = []
        try:
            for replica in fleet.members():
                server = fleet.servers[replica]
                try:
                    answer = self._load_answer(server, version)
                except ServerLostError as exc:
                    fleet.report_lost(replica, exc)
                    continue
                except GenerationError as exc:
                    answer = {"success": False, "message": str(exc)}
                if not answer.get("success"):
                    why = f"{server.name} refused the new weights: {answer.get('message')}"
                    if taken:
                        raise MixedWeightsError(f"{why}; {', '.join(taken)} took them")
                    self.client.each_server("/continue_generation", {})
                    raise WeightUpdateError(f"{why}; every server keeps its old weights")
                taken.append(server.name)
            if not taken:
                raise WeightUpdateError(
                    "no SGLang server was left to take the new weights (every member of the "
                    "update died); retry the update once a replacement serves"
                )
            fleet.committed(version)
            self.client.each_server("/continue_generation", {})
        finally:
            fleet.update_ended()

    def resume(self) -> None:
        """A dropped update ends: nothing reached a server before the commit, so paused rows
        go on with the old weights."""
        try:
            self.client.each_server("/continue_generation", {})
        finally:
            self.client.fleet().update_ended()

    def load(self, server: SglangServer, version: int) -> None:
        """A replacement takes the committed weights from the staged checkpoint.

        Raises:
            WeightUpdateError: SGLang refused them.
        """
        answer = self._load_answer(server, version)
        if not answer.get("success"):
            raise WeightUpdateError(
                f"{server.name} refused the staged weights of version {version}: "
                f"{answer.get('message')}"
            )

    def checksum(self, server: SglangServer) -> str:
        """SGLang's checksum of every parameter ``server`` holds (``/weights_checker``).

        Raises:
            GenerationError: SGLang gave none.
        """
        answer = self.client.post(server, "/weights_checker", {"action": "checksum"})
        checksum = answer.get("per_engine_checksum")
        if not answer.get("success") or not checksum:
            raise GenerationError(
                f"SGLang ({server.name}) gave no weight checksum: {answer.get('message')}"
            )
        return str(checksum)

    def _load_answer(self, server: SglangServer, version: int) -> Any:
        """``/update_weights_from_disk`` of the staged checkpoint into ``server``, labelled
        ``version``: SGLang's answer."""
        request = {
            "model_path": str(self.staged_dir),
            "weight_version": str(version),
            "load_format": "auto",  # the file holds real weights, whatever the server began with
        }
        return self.client.post(server, "/update_weights_from_disk", request)
