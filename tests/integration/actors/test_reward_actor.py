"""The reward-model role on real models: the tiny reward model (a Hugging Face sequence classifier
built offline) through HFRewardModelWrapper, a generative judge on a real vLLM engine (the tiny
LM, on the suite's shared engine), and the ``reward`` Ray actor behind the env pools' bounded
client, which waits for a lost actor's replacement."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlpost.actors.reward import UNPARSED, RewardModel, RewardSettings, start_reward
from rlpost.config import load_config
from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT
from rlpost.envs.reward_model import RemoteRewardModel
from rlpost.tiny.reward_model import conversation

pytestmark = pytest.mark.integration


def rm_config(path, *overrides):
    return load_config(None, [f"reward_model.name_or_path={path}", *overrides]).reward_model


def right_and_wrong(n: int) -> tuple[list, list]:
    """Right answers in the tag, and the same answers without it (the rule's 1.0 and 0.0)."""
    from rlpost.envs.arithmetic import make_arithmetic_rows

    rows = make_arithmetic_rows(n, seed=7, split="test")
    right = [conversation(r["question"], f"<answer>{r['answer']}</answer>") for r in rows]
    wrong = [conversation(r["question"], r["answer"]) for r in rows]
    return right, wrong


def test_the_tiny_classifier_scores_tagged_answers_above_untagged_ones_in_any_batching(tiny_reward_model_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    right, wrong = right_and_wrong(32)
    model = RewardModel(rm_config(tiny_reward_model_path, "reward_model.batch_size=5"))
    scores = model.score(right + wrong)
    assert scores.errors == {} and len(scores.scores) == 64
    assert min(scores.scores[:32]) > max(scores.scores[32:]) + 0.3  # the format half of the rule
    one_by_one = RewardModel(rm_config(tiny_reward_model_path, "reward_model.batch_size=1")).score(right[:6])
    assert one_by_one.scores == pytest.approx(scores.scores[:6], abs=1e-5)  # padding changes nothing
    # the wrapper's score is the model's own on the chat-rendered conversation
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_path)
    raw = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_path)
    ids = tokenizer(tokenizer.apply_chat_template(right[0], tokenize=False), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert raw(input_ids=ids).logits.item() == pytest.approx(scores.scores[0], abs=1e-5)
    # a conversation past max_length keeps its last tokens (the response) and still scores
    long = [conversation("What is 1 + 1? " * 200, "<answer>2</answer>")]
    short = RewardModel(rm_config(tiny_reward_model_path, "reward_model.max_length=64")).score(long)
    assert len(short.scores) == 1 and short.scores[0] == short.scores[0]
    assert model.num_scored == 64


def test_a_classifier_with_several_labels_is_refused(tmp_path, tiny_model_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 3 labels; a reward model has one"):
        RewardModel(rm_config(tmp_path))


def test_a_generative_judge_reads_its_verdict_from_a_real_engine_and_counts_unparsed_ones(tiny_model_path, plain_llm):
    """The tiny LM as a judge: its template asks it the arithmetic question in the response, and
    the verdict pattern reads the number in its answer tag: so the verdict is what the engine
    generated, parsed. A pattern its replies never match scores 0, counted."""
    from rlpost.policies import LocalVLLMClient

    engine = LocalVLLMClient(plain_llm)
    overrides = ["reward_model.kind=generative", "reward_model.judge.template='{completion}'",
                 r"reward_model.judge.pattern=<answer>\s*(-?\d+)\s*</answer>", "reward_model.judge.scale=1",
                 "reward_model.judge.max_tokens=12"]  # fmt: skip
    cfg = rm_config(tiny_model_path, *overrides)
    cfg.judge.system_prompt = ARITHMETIC_SYSTEM_PROMPT  # the tiny LM answers in its training format
    judge = RewardModel(cfg, engine=engine)
    questions = [f"What is {a} + {b}?" for a, b in ((2, 3), (10, 4), (7, 7), (1, 0))]
    result = judge.score([conversation("ignored", q) for q in questions])
    assert result.errors == {}
    replies = []
    for q in questions:
        messages = [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": q}]
        ids = judge.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]  # fmt: skip
        out = engine.generate([list(ids)], {"temperature": 0.0, "max_tokens": 12, "logprobs": False})[0][0]
        replies.append(judge.tokenizer.decode(out.token_ids, skip_special_tokens=True))
    assert result.scores == [float(r.split("<answer>")[1].split("</answer>")[0]) for r in replies]
    # the verdict follows the question the template rendered. Which sums the tiny LM gets right is
    # not asserted: its weights are the same bytes everywhere (models/), but the engine's CPU
    # kernels sum in an order that depends on the instruction set, and a near-tie of two tokens
    # can then go either way
    assert len(set(result.scores)) > 1

    strict = RewardModel(rm_config(tiny_model_path, *overrides[:2], "reward_model.judge.max_tokens=12"), engine=engine)
    unparsed = strict.score([conversation("ignored", q) for q in questions])
    assert unparsed.scores == [0.0] * 4 and unparsed.errors == {UNPARSED: 4}


def test_the_reward_actor_serves_the_env_pools_client_and_a_lost_one_is_waited_for(ray_cluster, tiny_reward_model_path):
    ray = ray_cluster
    cfg = load_config(None, [f"reward_model.name_or_path={tiny_reward_model_path}", "logging.run_name=rm-test"])
    settings = RewardSettings.from_job(cfg)
    actor = start_reward(settings, name="reward-test", num_cpus=0)
    client = RemoteRewardModel("reward-test", timeout_s=60, restart_wait_s=60)
    right, wrong = right_and_wrong(4)
    first = client.score(right + wrong, [None] * 8)
    local = RewardModel(cfg.reward_model).score(right + wrong)
    assert first.scores == pytest.approx(local.scores, abs=1e-5)

    # the actor dies (as the OOM killer would end it); a replacement comes 1.5 s later
    ray.kill(actor)
    started = []
    timer = threading.Timer(1.5, lambda: started.append(start_reward(settings, name="reward-test", num_cpus=0)))
    timer.start()
    t0 = time.monotonic()
    again = client.score(right, [None] * 4)
    assert time.monotonic() - t0 >= 1.4  # it waited for the new one
    assert again.scores == pytest.approx(local.scores[:4], abs=1e-5)

    # no replacement: the call fails after restart_wait_s, naming the actor
    ray.kill(started[0])
    impatient = RemoteRewardModel("reward-test", timeout_s=60, restart_wait_s=2)
    with pytest.raises(
        RuntimeError, match="the reward actor 'reward-test' is gone and no replacement answered within 2 s"
    ):
        impatient.score(right, [None] * 4)
