"""An engine killed by a signal is reported by the signal's name and its likely cause, not "code -4"
(issue 8): through a real agent and control plane, with a stand-in llama-server that dies of SIGILL the
way a native llama.cpp build does on a machine whose kernel forbids AMX. And the self-test's pieces:
the instruction scan finds AVX-512/AMX in a real object file, the CPU-feature check reads cpuinfo."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from llmgw.engines.exits import describe_exit, with_output
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.selftest import missing_cpu_features, unportable_instructions
from tests.helpers import wait_until


def test_describe_exit_names_signals_and_codes():
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-4).startswith("killed by SIGILL (illegal instruction): ")
    assert "out-of-memory" in describe_exit(-9)
    ill = LlamaCppAdapter().describe_exit(-4)
    assert "llama-server binary uses CPU instructions this machine cannot run" in ill
    assert "scripts/setup" in ill


def test_missing_cpu_features():
    assert missing_cpu_features("flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 amx_tile\n") == []
    assert missing_cpu_features("flags\t\t: fpu sse4_2 avx\n") == ["avx2", "fma", "f16c", "bmi2"]
    assert missing_cpu_features("Features\t: fp asimd\n") == []  # not x86: nothing to say


@pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("objdump")), reason="needs gcc and objdump")
@pytest.mark.parametrize("asm,unportable", [
    ("vpxord %zmm0, %zmm0, %zmm0", True),   # AVX-512
    ("tilezero %tmm4", True),                # AMX: the instruction seen dying with SIGILL
    ("vpxor %ymm0, %ymm0, %ymm0", False),    # AVX2: the portable baseline
])
def test_instruction_scan_finds_avx512_and_amx(tmp_path, asm, unportable):
    src = tmp_path / "k.c"
    src.write_text(f'void kernel(void) {{ __asm__ volatile("{asm}"); }}\n')
    lib = tmp_path / "bin" / "libggml-cpu.so"
    lib.parent.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    exe = lib.parent / "llama-server"
    exe.write_bytes(b"")  # not an object file: objdump says so and the scan goes on
    found, notes = unportable_instructions(exe)
    assert notes == ["objdump cannot read llama-server (not an object file?): it was not scanned"]
    assert bool(found) == unportable, found
    if unportable:
        assert found[0].startswith("libggml-cpu.so: ")


FAKE_SERVER = textwrap.dedent("""\
    #!{python}
    # A stand-in llama-server: prints a banner, optionally serves /health, then dies of SIGILL as a binary
    # built for another CPU does at its first matrix multiply.
    import os, signal, sys, threading, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("system_info: n_threads = 2 | CPU : AVX2 = 1 | AMX_INT8 = 1", flush=True)
    if {ready_first}:
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
                self.wfile.write(b"{{}}")
            def log_message(self, *a): pass
        srv = HTTPServer(("127.0.0.1", port), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        time.sleep({serve_s})
    print("tinygemm_kernel_amx", flush=True)
    os.kill(os.getpid(), signal.SIGILL)
""")


@pytest.mark.integration
@pytest.mark.parametrize("ready_first", [False, True], ids=["before-ready", "after-ready"])
def test_sigill_is_reported_by_name_through_the_real_path(control_plane, tmp_path, ready_first):
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_SERVER.format(python=sys.executable, ready_first=ready_first, serve_s=6))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    cp = control_plane.start()
    cp.agent("n1", LLMGW_LLAMA_SERVER=str(fake))
    cp.wait_nodes("n1")
    r = cp.apply({"models": [{"name": "m", "scaling": {"min": 1, "max": 1},
                              "profiles": [{"engine": "llamacpp", "source": str(weights)}]}]})
    assert r.status_code == 200, r.text
    if ready_first:
        cp.wait_replicas("m", "ready", timeout_s=60)

    def failed():
        return [x for x in cp.replicas() if x["model"] == "m" and x["status"] == "failed" and x.get("failure")]

    [rep, *_] = wait_until(failed, timeout_s=60, what="a failed replica", why=cp.logs)
    assert "killed by SIGILL (illegal instruction)" in rep["failure"], rep["failure"]
    assert "llama-server binary uses CPU instructions this machine cannot run" in rep["failure"]
    assert "code -4" not in rep["failure"]
    assert "tinygemm_kernel_amx" in rep["failure"]  # the engine's own last words come with it


def test_an_exit_is_told_with_the_line_of_output_that_says_why():
    usage = 'error while handling argument "--parallel": stoi\n\nusage:\n-np, --parallel N   number of slots\n\n' \
            "to show complete usage, run with -h\n"
    assert with_output("exited with code 1", usage) == 'exited with code 1: error while handling argument "--parallel": stoi'
    assert with_output("exited with code 2", "loading model\nbye\n") == "exited with code 2: bye"  # else the last line
    assert with_output("exited with code 1", "\n \n") == "exited with code 1"
    assert len(with_output("exited with code 1", "error: " + "x" * 1000)) < 260
    # Killed by a signal: its last line is what it was doing, not why; only a line naming an error is said.
    busy = "7.26.259.014 I slot launch_slot_: id 0 | task 109 | processing task\n"
    assert with_output("killed by SIGKILL", busy, signalled=True) == "killed by SIGKILL"
    assert with_output("killed by SIGABRT", "CUDA error: out of memory\n" + busy, signalled=True) == \
        "killed by SIGABRT: CUDA error: out of memory"


STOI_SERVER = textwrap.dedent("""\
    #!{python}
    # A stand-in llama-server given a flag value it cannot read: llama.cpp prints the error, then usage.
    import sys
    print('error while handling argument "--parallel": stoi', file=sys.stderr)
    print("\\nusage:\\n-np, --parallel N   number of parallel sequences\\n\\nto show complete usage, run with -h",
          file=sys.stderr)
    sys.exit(1)
""")


@pytest.mark.integration
def test_an_engine_that_exits_at_start_is_reported_with_its_words(control_plane, tmp_path):
    """The operator is told the engine's own reason, not only "exited with code 1"; the client is told how the
    engine ended and where an operator reads the rest, never what the engine printed (it may hold a logged
    prompt: issue 36); the node's log has one line for it, not a traceback."""
    import httpx

    fake = tmp_path / "llama-server"
    fake.write_text(STOI_SERVER.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    cp = control_plane.start()
    agent = cp.agent("n1", LLMGW_LLAMA_SERVER=str(fake))
    cp.wait_nodes("n1")
    assert cp.apply({"models": [{"name": "m", "scaling": {"min": 0, "max": 1},
                                 "profiles": [{"engine": "llamacpp", "source": str(weights)}]}]}).status_code == 200
    said = 'exited with code 1: error while handling argument "--parallel": stoi'
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and "exited with code 1" in message and "stoi" not in message, r.text
    line = next(ln for ln in cp.ctl("models").stdout.splitlines() if ln.startswith("m "))
    assert said in line, line
    assert "Traceback" not in agent.log() and said in agent.log(), agent.log()[-3000:]
