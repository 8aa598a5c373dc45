"""Bad answers are refused before anything is written, with one line naming the prompt."""

import pytest
from conftest import TEMPLATE
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter


# What each refusal says is accepted (with an example).
ALLOWED = {"project_slug": "letters, digits", "gpus_per_node": "whole number from 1",
           "num_nodes": "whole number from 1", "slurm_partition": "e.g. gpu or gpu,gpu-long",
           "slurm_account": "e.g. proj-1234", "slurm_time": "e.g. 24:00:00"}


@pytest.mark.parametrize(
    ("answers", "field"),
    [
        ({"project_slug": "my-proj"}, "project_slug"),
        ({"project_slug": "1abc"}, "project_slug"),
        ({"project_slug": "class"}, "project_slug"),
        ({"project_slug": ""}, "project_slug"),
        ({"gpus_per_node": "0"}, "gpus_per_node"),
        ({"gpus_per_node": "-1"}, "gpus_per_node"),
        ({"gpus_per_node": "abc"}, "gpus_per_node"),
        ({"gpus_per_node": "2.5"}, "gpus_per_node"),
        ({"num_nodes": "0"}, "num_nodes"),
        ({"num_nodes": "two"}, "num_nodes"),
        ({"slurm_partition": "gpu queue"}, "slurm_partition"),
        ({"slurm_partition": "gpu,"}, "slurm_partition"),
        ({"slurm_partition": "gpu;rm"}, "slurm_partition"),
        ({"slurm_account": "proj,other"}, "slurm_account"),
        ({"slurm_account": "$HOME"}, "slurm_account"),
        ({"slurm_time": ""}, "slurm_time"),
        ({"slurm_time": "24h"}, "slurm_time"),
        ({"slurm_time": "1:2:3:4"}, "slurm_time"),
        ({"slurm_time": "1-2:3:4:5"}, "slurm_time"),
    ],
)
def test_bad_answer_is_rejected(tmp_path, capfd, answers, field):
    with pytest.raises(FailedHookException):
        cookiecutter(str(TEMPLATE), no_input=True, extra_context=answers, output_dir=tmp_path)
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    value = next(iter(answers.values()))
    assert errors[0].startswith(f"error: {field} {value!r}")
    assert ALLOWED[field] in errors[0] or "keyword" in errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_unknown_scheduler_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="scheduler.*choices are \\['none', 'slurm'\\]"):
        cookiecutter(str(TEMPLATE), no_input=True, extra_context={"scheduler": "pbs"},
                     output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
