"""The quickstart's --real preset collects trajectories with vLLM when a vLLM environment is installed (issue 24):
the round-1 model is read from its HF export, the round-2 model is exported first (once), and the stage says which
collector it used."""

import json
from dataclasses import replace


def test_real_preset_collects_with_vllm_when_installed(tmp_path, monkeypatch):
    from recipes.quickstart import pipeline
    from recipes.quickstart.pipeline import Pipeline
    from recipes.quickstart.presets import PRESETS

    monkeypatch.setattr(pipeline, "vllm_python", lambda: "/envs/vllm/bin/python")
    logs = []
    pipe = Pipeline(tmp_path, replace(PRESETS["real"], traj2_prompts=2), log=logs.append)
    (tmp_path / "prompts_train.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_ids": [i]}) + "\n"
                                                          for i in range(5)))
    calls = []

    def fake_run(args, stage, python=None):  # the tool itself is covered by tests/test_vllm_collect.py
        calls.append(([str(a) for a in args], python))
        if "mcore-to-hf" in args:
            (tmp_path / "jf1_hf").mkdir()
        elif stage.startswith("traj"):
            (tmp_path / stage).mkdir(exist_ok=True)
            (tmp_path / stage / "manifest.json").write_text(json.dumps({"counts": {"records": 2}}))

    pipe.run = fake_run
    (tmp_path / "smollm2_hf").mkdir()  # stage base's HF export of model B
    info = pipe.stage_traj("traj1", "base", 16)
    args, py = calls[-1]
    assert py == "/envs/vllm/bin/python" and info["collector"] == "vllm" and len(calls) == 1
    assert args[args.index("--engine") + 1] == "vllm" and args[args.index("--load") + 1] == str(tmp_path / "smollm2_hf")
    assert any("collector: vLLM (/envs/vllm/bin/python)" in m for m in logs)
    pipe.stage_traj("traj2", "jf1", 32)
    (export, py_export), (args, py) = calls[1:]
    assert py_export is None and export[:2] == ["tools/convert_hf.py", "mcore-to-hf"]
    assert export[export.index("--load") + 1] == str(tmp_path / "jf1") and py == "/envs/vllm/bin/python"
    assert args[args.index("--load") + 1] == str(tmp_path / "jf1_hf") == export[export.index("--out") + 1]
    pipe.stage_traj("traj2", "jf1", 32)  # a resumed stage keeps the export (a new one would change the weights)
    assert [c[0][0] for c in calls[3:]] == ["tools/generate_trajectories.py"]
    # without vLLM: this project's engine on the megatron checkpoint, and the log says so
    monkeypatch.setattr(pipeline, "vllm_python", lambda: None)
    info = pipe.stage_traj("traj1", "base", 16)
    args, py = calls[-1]
    assert py is None and "--engine" not in args and args[args.index("--load") + 1] == str(tmp_path / "base")
    assert info["collector"] == "megatron" and "not installed" in logs[-1]
