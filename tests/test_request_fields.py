"""The tables of accepted request fields: docs/api.md lists exactly what each endpoint's model accepts,
and a field accepted only at its neutral value takes each of them and refuses anything else by
name. (What the implemented fields do, through a real server: tests/test_server.py.)"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from pydantic import ValidationError

from dpserve.sampling_params import NEUTRAL, SamplingParams
from dpserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequestBody

API_DOC = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
MINIMAL = {
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    CompletionRequest: {"model": "m", "prompt": "hi"},
    GenerateRequestBody: {"text": "hi"},
}


def readme_table(title: str) -> set[str]:
    """The field names in the first column of the docs/api.md table under `title`."""
    rows = API_DOC.split(f"\n{title}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {name for row in rows for name in re.findall(r"`(\w+)`", row.split(" | ")[0])}


@pytest.mark.parametrize(
    "title,model",
    [
        ("`/v1/chat/completions`:", ChatCompletionRequest),
        ("`/v1/completions`:", CompletionRequest),
        ("`/generate`:", GenerateRequestBody),
    ],
)
def test_readme_lists_every_accepted_field(title, model):
    assert readme_table(title) == model.accepted_fields()


def test_readme_lists_every_sampling_parameter():
    accepted = {f.name for f in fields(SamplingParams)} | set(NEUTRAL) | {"stop", "sampling_seed"}
    assert readme_table("`/generate`'s `sampling_params` (and the offline `Engine`'s):") == accepted


@pytest.mark.parametrize("model", list(MINIMAL))
def test_neutral_values_only(model):
    for name, accepted in model.NEUTRAL.items():
        for value in accepted:
            model.model_validate({**MINIMAL[model], name: value})
        with pytest.raises(ValidationError, match=re.escape(f'{name}="other" is not supported (only ')):
            model.model_validate({**MINIMAL[model], name: "other"})


def test_sampling_params_neutral_values_and_seed_alias():
    for name, accepted in NEUTRAL.items():
        for value in accepted:
            SamplingParams.from_dict({name: value})
        with pytest.raises(ValueError, match=f"^{name} is not supported"):
            SamplingParams.from_dict({name: 2})
    assert SamplingParams.from_dict({"sampling_seed": 5, "logit_bias": {"7": 1.5}}) == SamplingParams(
        seed=5, logit_bias={7: 1.5}
    )
    with pytest.raises(ValueError, match="seed=4 and sampling_seed=5 differ"):
        SamplingParams.from_dict({"seed": 4, "sampling_seed": 5})
