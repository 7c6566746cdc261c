"""OS isolation of generated code and a verdict it cannot write (megatron_jf.eval.sandbox / verdict).

Every escape and forgery below is written as a *wrong* HumanEval/MBPP completion that also attacks the
evaluator; each must score as not passed, leave the host untouched (files, processes, temp dirs) and leave the
evaluator alive.
"""

import glob
import os
import tempfile
import textwrap
import time
import uuid

import pytest

from megatron_jf.eval import sandbox
from megatron_jf.eval.benchmarks import Problem, load_benchmark
from megatron_jf.eval.code_exec import run_program
from megatron_jf.eval.sandbox import SandboxUnavailable, check_isolation
from megatron_jf.eval.scoring import aggregate, score, score_many
from megatron_jf.eval.verdict import verify_humaneval, verify_mbpp
from tests.sandbox_marks import WHY, needs_os


@pytest.fixture(scope="module")
def he0():
    return load_benchmark("humaneval", limit=1)[0]  # has_close_elements(numbers, threshold) -> bool


def _wrong(attack: str) -> str:
    """A wrong has_close_elements (always False) preceded by an attack that runs when the solution loads."""
    return "```python\n" + textwrap.dedent(attack) + "\n\ndef has_close_elements(numbers, threshold):\n" \
        "    return False\n```"


MARK = "JF_ESCAPE_MARK_" + uuid.uuid4().hex[:12]  # unique: other test runs may share this machine


def _host_state():
    """Host processes whose command line carries this run's marker (sandboxed ones included: the host sees them)."""
    procs = set()
    for d in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(d, "rb") as f:
                if MARK.encode() in f.read():
                    procs.add(d)
        except OSError:
            pass
    return procs


@pytest.fixture()
def no_host_tempdirs(monkeypatch):
    """With OS isolation nothing is created on the host: creating a temp dir fails the test."""
    def boom(*a, **k):
        raise AssertionError("a host temp dir was created")
    monkeypatch.setattr(tempfile, "mkdtemp", boom)


@needs_os
def test_isolation_works_here_and_is_what_it_claims():
    assert WHY is None, WHY
    prog = textwrap.dedent("""
        import os, socket
        assert os.getuid() == 65534 and os.getgid() == 65534
        assert os.getpid() == 2 and os.getppid() == 1           # own PID namespace under bwrap's PID 1
        assert sorted(p for p in os.listdir('/proc') if p.isdigit()) == ['1', '2']
        assert not os.path.exists('/work') and not os.path.exists('/root/.ssh') and not os.path.exists('/home')
        assert not os.access('/usr/bin', os.W_OK)
        try:
            open('/usr/lib/x', 'w')
            raise AssertionError('wrote into /usr')
        except OSError:
            pass
        s = socket.socket()
        assert s.connect_ex(('1.1.1.1', 53)) != 0                # no network
        open('scratch.txt', 'w').write('ok')                     # private tmpfs cwd
        assert os.getcwd() == '/tmp/jf_work'
    """)
    r = run_program(prog, block_processes=False, audit_guard=False)  # the OS alone, without the audit hook
    assert r.passed, r.message


def test_refuses_without_namespaces_unless_told(monkeypatch, he0):
    monkeypatch.setattr(sandbox, "_probe", lambda: "user namespaces are disabled (test)")
    with pytest.raises(SandboxUnavailable, match="refusing to execute generated code.*--unisolated"):
        check_isolation("os")
    with pytest.raises(SandboxUnavailable):
        score(he0, he0.reference)
    with pytest.raises(SandboxUnavailable):
        score_many([he0], [he0.reference])
    s = score(he0, he0.reference, isolation="none")
    assert s.correct and s.isolation == "none" and s.verdict == "split"
    assert aggregate([s])["humaneval"]["unisolated"] == 1
    with pytest.raises(ValueError, match="isolation"):
        check_isolation("maybe")


ESCAPES = {
    # the escapes that got through the in-process guard
    "dir_fd": """
        import os
        fd = os.open('/', os.O_RDONLY)
        os.close(os.open({rel_target!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=fd))
        os.close(os.open({rel_new!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=fd))
    """,
    "fork_exec_setsid": """
        import _posixsubprocess, os
        args = [b'/bin/sh', b'-c', b'sleep 4; echo pwned > {target}; : {mark}']
        try:
            _posixsubprocess.fork_exec(args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1,
                                       *os.pipe(), True, True, -1, None, None, None, -1, None, False)
        except Exception:
            pass
    """,
    "pidfd_kill_parent": """
        import os, signal
        for pid in (os.getppid(), 1):
            try:
                signal.pidfd_send_signal(os.pidfd_open(pid), 9)
            except Exception:
                pass
    """,
    "kill_everything": """
        import os
        for pid in range(1, 4096):
            try:
                os.kill(pid, 9)
            except Exception:
                pass
    """,
    "guard_off_via_gc": """
        import gc
        for o in gc.get_objects():
            if type(o) is list and o == [] and False:
                pass
        for o in gc.get_objects():
            try:
                if callable(o) and getattr(o, '__name__', '') == 'hook' and o.__closure__:
                    for c in o.__closure__:
                        if type(c.cell_contents) is list:
                            c.cell_contents.append(1)   # 'busy' -> the hook returns at once
            except Exception:
                pass
        open({target!r}, 'w').write('pwned')
    """,
    "forged_result_line": """
        import sys, os, json
        f = sys._getframe()
        while f is not None:
            loc = f.f_locals
            if 'result_fd' in loc:
                for obj in ({{'nonce': loc.get('nonce', ''), 'status': 'passed', 'message': ''}}, {{'ready': True}},
                            {{'ok': ['b', True], 'after': []}}):
                    os.write(loc['result_fd'], (json.dumps(obj) + '\\n').encode())
            f = f.f_back
    """,
    "violations_cleared": """
        import sys
        try:
            open({target!r}, 'w')
        except Exception:
            pass
        f = sys._getframe()
        while f is not None:
            if 'violations' in f.f_locals:
                f.f_locals['violations'].clear()
            f = f.f_back
    """,
    "always_equal": """
        class _Yes:
            def __eq__(self, other): return True
            def __bool__(self): return True
        def has_close_elements(numbers, threshold):
            return _Yes()
    """,
    "exit_early": """
        import os
        os._exit(0)
    """,
}


@needs_os
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_is_contained_and_scores_failed(name, he0, tmp_path, no_host_tempdirs):
    target = tmp_path / "victim.txt"
    target.write_text("intact")
    new = tmp_path / "created.txt"
    attack = ESCAPES[name].format(target=str(target), rel_target=str(target).lstrip("/"),
                                  rel_new=str(new).lstrip("/"), mark=MARK)
    before = _host_state()
    completion = _wrong(attack)
    if name == "always_equal":  # the forged object replaces the wrong function
        completion = "```python\n" + textwrap.dedent(attack) + "\n```"
    s = score(he0, completion, timeout_s=8)
    assert not s.correct and s.status != "passed", s
    assert s.verdict == "split"
    time.sleep(5 if name == "fork_exec_setsid" else 0)  # a surviving grandchild would write after 4 s
    assert target.read_text() == "intact" and not new.exists()
    assert sorted(os.listdir(tmp_path)) == ["victim.txt"]
    assert _host_state() == before  # no process left behind (and no temp dir: no_host_tempdirs)
    assert score(he0, he0.reference).correct  # the evaluator still works


@needs_os
def test_grandchild_in_setsid_dies_with_the_sandbox_even_when_processes_are_allowed(no_host_tempdirs):
    # process creation allowed (no RLIMIT_NPROC, no audit refusal of _posixsubprocess): the PID namespace still
    # takes a setsid grandchild down when the sandbox ends, normally or at the timeout
    prog = textwrap.dedent(f"""
        import _posixsubprocess, os
        args = [b'/bin/sh', b'-c', b'exec sleep 30 # {MARK}']
        _posixsubprocess.fork_exec(args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1,
                                   *os.pipe(), True, True, -1, None, None, None, -1, None, False)
    """)
    for extra in ("", "import time\ntime.sleep(60)\n"):
        before = _host_state()
        r = run_program(prog + extra, block_processes=False, audit_guard=False, timeout_s=3)
        assert r.status in ("passed", "timeout"), r
        time.sleep(0.5)
        assert _host_state() == before


@needs_os
def test_wrong_solutions_never_pass_in_any_form(he0):
    for completion in (
        "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```",
        "    return None\n",
        "```python\nclass T(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
        "def has_close_elements(numbers, threshold):\n    return T(0)\n```",
        "```python\nimport builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
        "def has_close_elements(numbers, threshold):\n    return 0\n```",
        "```python\ndef has_close_elements(numbers, threshold):\n    raise SystemExit(0)\n```",
        "```python\nhas_close_elements = 3\n```",
    ):
        s = score(he0, completion, timeout_s=8)
        assert not s.correct, (completion, s)


@needs_os
def test_split_verdict_semantics():
    def mb(tests, setup=""):
        return dict(tests=tests, test_setup=setup)

    # in-place mutation, generators, expected exceptions, builtin-shadowing names, stdlib used only by the test
    code = textwrap.dedent("""
        import math
        def sort_in_place(xs):
            xs.sort()
        def upto(n):
            return (i for i in range(n))
        def checked(x):
            if x < 0:
                raise ValueError('negative')
            return math.sqrt(x)
        def sum(a, b):
            return a * b
    """)
    tests = ["xs = [3, 1, 2]; sort_in_place(xs); assert xs == [1, 2, 3]",
             "assert list(upto(3)) == [0, 1, 2]",
             "assert math.isclose(checked(2), 1.41421356, rel_tol=1e-6)",
             "try:\n    checked(-1)\n    assert False\nexcept ValueError:\n    pass",
             "try:\n    checked('a')\n    assert False\nexcept TypeError:\n    pass",
             "assert sum(2, 3) == 6"]  # the entry point shadows a builtin (as mbpp/126's `sum`)
    r = verify_mbpp(code, tests, entry_point="sum")
    assert r.passed and r.verdict == "split", r
    r = verify_mbpp(code.replace("a * b", "a + b"), tests, entry_point="sum")
    assert r.status == "failed" and "at test line 14: assert sum(2, 3) == 6" in r.message, r
    r = verify_mbpp(code.replace("xs.sort()", "xs = sorted(xs)"), tests, entry_point="sum")
    assert r.status == "failed" and "assert xs == [1, 2, 3]" in r.message, r
    # a test_setup that needs the solution's own class: its objects stay in the sandbox
    tree = "class Node:\n    def __init__(self, v):\n        self.v = v\ndef value(n):\n    return n.v\n"
    r = verify_mbpp(tree, ["assert value(root) == 7"], "root = Node(7)", entry_point="value")
    assert r.passed and r.verdict == "split", r
    # the solution's helpers do not leak into the trusted check, and a timeout is a timeout
    r = verify_mbpp("def f(x):\n    while True:\n        pass\n", ["assert f(1) == 1"], entry_point="f", timeout_s=2)
    assert r.status == "timeout"


@needs_os
def test_humaneval_check_uses_prompt_helpers_and_not_the_solutions(tmp_path):
    he = {p.task_id: p for p in load_benchmark("humaneval")}
    p = he["HumanEval/38"]  # decode_cyclic: the check encodes with the prompt's encode_cyclic
    wrong = "```python\ndef encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n```"
    r = verify_humaneval(p.prompt, wrong.split("```python\n")[1].rstrip("`\n"), p.entry_point, p.tests[0])
    assert r.status == "failed" and r.verdict == "split"
    assert score(p, p.reference).correct
    # a local JSONL problem whose check passes a function: not splittable, verdict from inside the sandbox
    odd = Problem(task_id="odd/0", benchmark="humaneval", prompt="def apply(f, x):\n    \"\"\"f(x).\"\"\"\n",
                  tests=("def check(candidate):\n    assert candidate(abs, -2) == 2\n",), entry_point="apply")
    s = score(odd, "    return f(x)\n")
    assert s.correct and s.verdict == "in-sandbox" and "not split" in s.message
    assert aggregate([s])["humaneval"]["in_sandbox_ids"] == ["odd/0"]


@needs_os
def test_sandbox_dies_with_the_evaluator():
    import signal
    import subprocess
    import sys

    code = ("from megatron_jf.eval.code_exec import run_program\n"
            "print('started', flush=True)\n"
            f"run_program('import time\\ntime.sleep(60)  # {MARK}\\n', timeout_s=120)\n")
    before = _host_state()
    ev = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert ev.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 30
    while _host_state() == before and time.monotonic() < deadline:  # the sandboxed sleeper is up
        time.sleep(0.2)
    assert _host_state() != before
    ev.send_signal(signal.SIGKILL)
    ev.wait()
    ev.stdout.close()
    deadline = time.monotonic() + 10
    while _host_state() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _host_state() == before  # bwrap --die-with-parent took the whole sandbox down
