"""Session-wide test environment: CPU DeepSpeed, Ray on loopback, no hub access."""

import os
import socket
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPORA = REPO.parent / "shared" / "corpora"
SHARED_DOWNSTREAM = REPO.parent / "shared" / "downstream"

# Set before any test imports deepspeed, ray or transformers.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Ray binds the machine's routable address by default; this switch keeps the node and all its
# services on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test leaves os.environ and the temp folder as it found them. An in-process run of the
    trainer describes a world of one (RANK, LOCAL_WORLD_SIZE=1, ...) and the loader may point TMPDIR
    at a node's folder; a later test's launch would otherwise inherit them (two ranks of one
    deepspeed launch taken for two nodes). Session fixtures set up before this snapshot."""
    import tempfile

    env, tmp = dict(os.environ), tempfile.tempdir
    yield
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = tmp


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def corpora() -> Path:
    """../shared/corpora, or a skip with the reason when a fresh clone does not have it."""
    if not SHARED_CORPORA.is_dir():
        pytest.skip(f"needs real text in {SHARED_CORPORA} (absent on a fresh clone)")
    return SHARED_CORPORA


@pytest.fixture(scope="session")
def downstream() -> Path:
    """../shared/downstream (real labelled tasks), or a skip with the reason when it is absent."""
    if not SHARED_DOWNSTREAM.is_dir():
        pytest.skip(f"needs the labelled tasks in {SHARED_DOWNSTREAM} (absent on a fresh clone)")
    return SHARED_DOWNSTREAM


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config._tokencl_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    # A test that failed mid-epoch can leave streaming's worker threads polling forever, and the
    # interpreter joins every non-daemon thread at exit: the run would hang after its summary (CI
    # killed on time with every result already printed). Name them and exit with pytest's status.
    leaked = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if leaked:
        names = ", ".join(sorted({t.name for t in leaked}))
        print(
            f"\nconftest: {len(leaked)} non-daemon thread(s) still running after the session ({names}); "
            "exiting without joining them",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(config, "_tokencl_exitstatus", 1))


# ---------------------------------------------------------------------------------------------------
# The two tiers: "fast" = tests/unit without the multiproc marker (in-process: `make test-fast`), and
# the rest (real DeepSpeed, Ray and Slurm jobs, subprocesses). The summary gives each tier's time.
# ---------------------------------------------------------------------------------------------------

_TIER_SECONDS: dict[str, float] = {}
_TIER_COUNTS: dict[str, int] = {}


def tier_of(item) -> str:
    in_unit = Path(str(item.fspath)).resolve().is_relative_to(REPO / "tests" / "unit")
    return "fast" if in_unit and item.get_closest_marker("multiproc") is None else "slow"


def pytest_runtest_logreport(report) -> None:
    tier = "fast" if "fast_tier" in report.keywords else "slow"
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
    if report.when == "call":
        _TIER_COUNTS[tier] = _TIER_COUNTS.get(tier, 0) + 1


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if tier_of(item) == "fast":
            item.add_marker("fast_tier")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TIER_SECONDS:
        return
    parts = [
        f"{tier} tier: {_TIER_COUNTS.get(tier, 0)} tests, {_TIER_SECONDS[tier]:.0f} s"
        for tier in ("fast", "slow")
        if tier in _TIER_SECONDS
    ]
    terminalreporter.write_line("test time by tier (setup + call + teardown): " + "; ".join(parts))
