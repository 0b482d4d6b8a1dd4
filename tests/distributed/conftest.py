import json
from pathlib import Path

import pytest

from tests.distributed.two_rank_scenario import scenario_worker
from tests.helpers.distributed import run_spawned


@pytest.fixture(scope="session")
def ddp_result(tmp_path_factory) -> tuple[dict, Path]:
    """The observations of ``scenario_worker`` on 2 ranks (one spawn for the session) and its output folder."""
    out = tmp_path_factory.mktemp("ddp")
    run_spawned(scenario_worker, 2, out)
    return json.loads((out / "result.json").read_text()), out
