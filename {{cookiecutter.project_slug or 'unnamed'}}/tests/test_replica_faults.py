"""A replica group's launch that cannot work (torchft): no lighthouse at TORCHFT_LIGHTHOUSE, an
address that is none, a program there that is not a lighthouse; run_replicas.sh's lighthouse
that cannot start, a Python without torchft. Each is one line and exit 2, before any worker
starts: no traceback, no run folder, no lock (and nothing left in the temp folder, see conftest).
"""

import http.server
import socket
import sys
import threading

import pytest
from test_launch import free_port

from conftest import TINY, needs_extra, run

needs_extra("torchft")


def refusal(result, tmp_path) -> str:
    """The one line a refused launch printed."""
    assert result.returncode == 2, result.stdout
    assert len(result.stdout.strip().splitlines()) == 1, result.stdout
    assert not (tmp_path / "runs").exists()  # no run folder, so no .lock-group-0 either
    return result.stdout.strip()


def launch_group(tmp_path, lighthouse: str):
    return run(["./run.sh", *TINY, f"run.output_dir={tmp_path / 'runs'}"], timeout=120,
               REPLICA_GROUP="0", REPLICA_GROUPS="1", NPROC_PER_NODE="1",
               RDZV_ID=f"replicas-{tmp_path.name}", TORCHFT_LIGHTHOUSE=lighthouse)


def test_no_lighthouse_at_the_address_is_one_line_before_any_worker(tmp_path):
    port = free_port()  # nothing listens there
    line = refusal(launch_group(tmp_path, f"http://127.0.0.1:{port}"), tmp_path)
    assert line == (f"error: no torchft lighthouse at TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port} "
                    f"(nothing listens there): start it first (torchft_lighthouse --min_replicas "
                    f"1 --bind [::]:{port} on 127.0.0.1), or set TORCHFT_LIGHTHOUSE to its "
                    "address (run_replicas.sh starts one and sets it)")


@pytest.mark.parametrize("address", ["localhost:29510", "http://localhost/"])
def test_an_address_that_is_not_http_host_port_is_one_line(tmp_path, address):
    line = refusal(launch_group(tmp_path, address), tmp_path)
    assert line == (f"error: TORCHFT_LIGHTHOUSE={address} is not a lighthouse's address: give it "
                    "as http://<host>:<port>, e.g. http://localhost:29510")


class NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the name http.server calls)
        self.send_error(404)

    def log_message(self, *args):  # not on the test's output
        pass


def test_a_program_that_is_not_a_lighthouse_at_the_address_is_one_line(tmp_path):
    with http.server.HTTPServer(("127.0.0.1", 0), NotFound) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        address = f"http://127.0.0.1:{server.server_address[1]}"
        result = launch_group(tmp_path, address)
        server.shutdown()
    assert refusal(result, tmp_path) == (
        f"error: TORCHFT_LIGHTHOUSE={address} is not a torchft lighthouse (the program there "
        "answers HTTP 404 Not Found): set TORCHFT_LIGHTHOUSE to the lighthouse's address, "
        "http://<host>:<port>")


def launch_replicas(tmp_path, **env: str):
    return run(["./run_replicas.sh", *TINY, f"run.output_dir={tmp_path / 'runs'}"],
               timeout=120, REPLICA_GROUPS="2", NPROC_PER_NODE="1", **env)


def test_a_lighthouse_port_out_of_range_is_one_line(tmp_path):
    line = refusal(launch_replicas(tmp_path, LIGHTHOUSE_PORT="70000"), tmp_path)
    assert line == "error: LIGHTHOUSE_PORT=70000 is not valid: it must be a port number, 1 to 65535"


def test_a_lighthouse_that_cannot_start_is_one_line_before_any_group(tmp_path):
    # A socket bound but not listening: the port looks free to a connection, yet the lighthouse
    # cannot bind it (as with a program bound to another of this machine's addresses).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        line = refusal(launch_replicas(tmp_path, LIGHTHOUSE_PORT=str(port)), tmp_path)
    assert line.startswith(f"error: torchft_lighthouse could not start on port {port} (")
    assert line.endswith("): set LIGHTHOUSE_PORT to a free port")
    assert "Address already in use" in line  # torchft's own words, between the parentheses


def test_a_python_without_torchft_is_one_line_for_all_groups(tmp_path):
    hidden = tmp_path / "hide-torchft"  # this Python, as if torchft were not installed
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")
    line = refusal(launch_replicas(tmp_path, PYTHONPATH=str(hidden),
                                   LIGHTHOUSE_PORT=str(free_port())), tmp_path)
    assert line == (f"error: {sys.executable} lacks torchft, which replica groups need: install "
                    "the torchft extra (pip install -e '.[torchft]') there, or set PYTHON to the "
                    "Python that has it")
