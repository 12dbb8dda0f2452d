import pytest

from radixserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"stop_regex": "("}, "stop_regex '\\(' is not a valid regular expression"),
        ({"stop_regex": ["ok", "a*"]}, "matches the empty string"),
        ({"stop_regex": [""]}, "stop_regex must be a non-empty string"),
        ({"stop_regex": 3}, "stop_regex must be a string or a list"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"stop": [""]}, "non-empty strings"),
        ({"stop": [3]}, "non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"logprobs": 21}, "at most 20"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_values_raise_clear_errors(values, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**values)


def test_unknown_fields_from_dicts_are_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter.*top_q"):
        SamplingParams.from_dict({"top_q": 0.5})


def test_normalisation():
    p = SamplingParams(stop="END", top_k=-1, max_tokens=None)
    assert p.stop == ["END"] and p.top_k == 0 and p.max_tokens is None
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop=["ab", "abcd"]).max_stop_len == 4
