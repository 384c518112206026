"""RetrieveLogProb / KLComputation / RetrieveKL / KLRewardTransform on the real tiny model and
tokenizer: values, padded and unpadded layouts, inside an env, and the shared Ray service."""

import copy

import pytest
import torch
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs import ChatEnv
from rlpost.envs.kl import KLComputation, RayRetrieveKL, RetrieveKL, RetrieveLogProb
from rlpost.envs.kl_reward import KLRewardTransform
from rlpost.policies import TransformersWrapper

pytestmark = pytest.mark.integration

SYSTEM = "Answer with <answer>number</answer>."
CHATS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 + 4?"},
     {"role": "assistant", "content": "<answer>7</answer>"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 10 - 2?"},
     {"role": "assistant", "content": "<answer>9</answer> and more words"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_model_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return policy, reference


def scorer(model, tok, key, pad_output=True, input_mode="history"):
    return TransformersWrapper(model, tokenizer=tok, input_mode=input_mode, generate=False, pad_output=pad_output,
                               log_probs_key=key)  # fmt: skip


def batch():
    return TensorDict(history=ChatHistory(full=History.from_chats(CHATS), batch_size=[2]), batch_size=[2])


def rendered_ids(tok, chats, generation_prompt=False):
    return [
        tok.apply_chat_template(chat, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt)[
            "input_ids"
        ]
        for chat in chats
    ]


def assistant_counts(tok):
    return [
        sum(
            tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)[
                "assistant_masks"
            ]
        )
        for chat in CHATS
    ]


@pytest.mark.parametrize("pad_output", [True, False])
def test_retrieve_log_prob_keeps_only_assistant_tokens(models, tiny_tokenizer, pad_output):
    policy, _ = models
    out = RetrieveLogProb(scorer(policy, tiny_tokenizer, "log_probs", pad_output))(batch())
    # unpadded rows come back one tensor per row, as from TorchRL's transform
    lp = out.get(("log_probs", "full"), as_list=not pad_output)
    rows = list(lp.unbind(0)) if pad_output else lp
    assert isinstance(lp, torch.Tensor if pad_output else list) and len(rows) == 2
    assert [int((row != 0).sum()) for row in rows] == assistant_counts(tiny_tokenizer)
    assert all((row[row != 0] < 0).all() for row in rows)
    if pad_output:  # left padding: the shorter row starts with zeros
        lengths = [len(ids) for ids in rendered_ids(tiny_tokenizer, CHATS)]
        assert lp.shape == (2, max(lengths))


@pytest.mark.parametrize("pad_output", [True, False])
def test_same_model_gives_zero_kl_and_a_per_token_reward(models, tiny_tokenizer, pad_output):
    policy, _ = models
    data = batch()
    data.set("next", TensorDict(reward=torch.tensor([[1.0], [0.1]]), batch_size=[2]))
    kl = RetrieveKL(scorer(policy, tiny_tokenizer, "gen_log_probs", pad_output),
                    scorer(policy, tiny_tokenizer, "ref_log_probs", pad_output), coeff=0.5)  # fmt: skip
    out = kl(data)["next"]
    for kl_row, reward_row, reward in zip(out["kl_penalty"].unbind(0), out["reward"].unbind(0), (1.0, 0.1)):
        assert kl_row.abs().max() == 0
        assert reward_row.shape == (kl_row.shape[0], 1) and torch.all(reward_row == reward)


def test_reference_kl_is_subtracted_per_token(models, tiny_tokenizer):
    policy, reference = models
    data = batch()
    data.set("next", TensorDict(reward=torch.tensor([[1.0], [0.1]]), batch_size=[2]))
    out = RetrieveKL(scorer(policy, tiny_tokenizer, "gen_log_probs"), scorer(reference, tiny_tokenizer, "ref_log_probs"),
                     coeff=0.5)(data)["next"]  # fmt: skip
    lp, ref, kl = out.get(("log_probs", "full")), out.get(("ref_log_probs", "full")), out.get("kl_penalty")
    assert torch.allclose(kl, lp - ref) and kl.abs().sum() > 0
    assert ((kl != 0) <= (lp != 0)).all()  # only assistant tokens carry a KL
    expected = torch.tensor([1.0, 0.1]).view(2, 1, 1) - 0.5 * kl.unsqueeze(-1)
    assert torch.allclose(out.get("reward"), expected)


def test_kl_for_the_loss_leaves_reward_alone_and_k3_is_non_negative():
    lp = torch.tensor([[-1.0, -2.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    td = TensorDict({("log_probs", "full"): lp, ("ref_log_probs", "full"): ref, "reward": torch.tensor([[1.0]])},
                    batch_size=[1])  # fmt: skip
    out = KLComputation(add_to_reward=False, estimator="k3")(td)
    d = ref - lp
    assert torch.allclose(out.get("kl_penalty"), d.exp() - d - 1) and (out.get("kl_penalty") >= 0).all()
    assert out.get("kl_penalty")[0, -1] == 0  # masked tokens (zero on both sides) carry no KL
    assert out.get("reward").tolist() == [[1.0]]


def test_retrieve_kl_inside_an_env_step(models, tiny_tokenizer):
    """Appended to a ChatEnv: the KL is computed at each step from the policy's full history."""
    policy, reference = models
    env = ChatEnv(batch_size=(2,), system_prompt=SYSTEM, tokenizer=tiny_tokenizer).append_transform(
        RetrieveKL(scorer(policy, tiny_tokenizer, "gen_log_probs"), scorer(reference, tiny_tokenizer, "ref_log_probs"))
    )
    td = env.reset(TensorDict(query=["What is 3 + 4?", "What is 10 - 2?"], batch_size=(2,)))
    td["history"].full = History.from_chats(CHATS)
    step = env.step(td)
    assert step["next", "kl_penalty"].shape[0] == 2 and step["next", "reward"].ndim == 3
    assert step["next", "done"].shape == (2, 1)


def test_from_collector_builds_the_scoring_twin_of_the_collector_policy(models, tiny_tokenizer):
    policy, reference = models
    generator = TransformersWrapper(policy, tokenizer=tiny_tokenizer, input_mode="history", generate=True)

    class Collector:  # what the transform reads: the collector's policy
        def __init__(self, policy):
            self.policy = policy

    transform = RetrieveKL("from_collector", scorer(reference, tiny_tokenizer, "ref_log_probs"), add_to_reward=False)
    with pytest.raises(ValueError, match="needs a collector"):
        transform(batch())
    transform.collector = Collector(generator)
    out = transform(batch())
    assert out.get("kl_penalty").abs().sum() > 0 and len(transform) == 3


def test_kl_reward_transform_legacy_tokens_mode(models, tiny_tokenizer):
    policy, reference = models
    ids = [torch.tensor(i) for i in rendered_ids(tiny_tokenizer, CHATS)]
    prompts = [torch.tensor(i) for i in rendered_ids(tiny_tokenizer, [chat[:-1] for chat in CHATS], True)]
    gen = scorer(policy, tiny_tokenizer, "log_probs", pad_output=False, input_mode="tokens")
    from tensordict import lazy_stack

    from rlpost.data import Tokens

    tokens = lazy_stack([Tokens(prompt=p, full=f, padded=False) for p, f in zip(prompts, ids)])
    data = gen(TensorDict(tokens=tokens, batch_size=[2]))
    data.set("next", TensorDict(reward=torch.tensor([[1.0], [0.0]]), batch_size=[2]))
    ref = scorer(reference, tiny_tokenizer, "ref_log_probs", pad_output=False, input_mode="tokens")
    out = KLRewardTransform(ref, coef=0.5)(data)["next"]
    kl_rows = list(out["kl_penalty"].unbind(0))
    assert [row.shape[0] for row in kl_rows] == [len(i) for i in ids]
    assert all(row[: len(p)].abs().sum() == 0 for row, p in zip(kl_rows, prompts))  # prompt tokens excluded
    for row, reward_row, reward in zip(kl_rows, out["reward"].unbind(0), (1.0, 0.0)):
        assert torch.allclose(reward_row, reward - 0.5 * row)
    with pytest.raises(ValueError, match="tokens as input"):
        KLRewardTransform(scorer(reference, tiny_tokenizer, "ref_log_probs"))


def test_bad_configurations_are_refused(models, tiny_tokenizer):
    policy, _ = models
    generator = TransformersWrapper(policy, tokenizer=tiny_tokenizer, input_mode="history", generate=True)
    with pytest.raises(ValueError, match="needs a scoring model"):
        RetrieveLogProb(generator)
    with pytest.raises(ValueError, match="input_mode='history'"):
        RetrieveLogProb(scorer(policy, tiny_tokenizer, "log_probs", input_mode="tokens"))
    same = scorer(policy, tiny_tokenizer, "log_probs")
    with pytest.raises(ValueError, match="different log_probs_key"):
        RetrieveKL(same, same)
    with pytest.raises(ValueError, match="pad_output mismatch"):
        RetrieveKL(scorer(policy, tiny_tokenizer, "a", True), scorer(policy, tiny_tokenizer, "b", False))
    td = TensorDict(
        {("log_probs", "full"): torch.zeros(1, 3), ("ref_log_probs", "full"): torch.zeros(1, 4)}, batch_size=[1]
    )
    with pytest.raises(ValueError, match="differ"):
        KLComputation(add_to_reward=False)(td)
    with pytest.raises(ValueError, match=r"\('ref_log_probs', 'full'\)"):
        KLComputation()(TensorDict({("log_probs", "full"): torch.zeros(1, 3)}, batch_size=[1]))


def test_ray_service_is_one_named_actor_shared_by_envs(ray_cluster, tiny_model_path, tiny_tokenizer):
    """use_ray_service=True: the first transform starts the actor, a second one with the same
    name attaches to it, and both compute the same KL as a local RetrieveKL."""
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_path)

    def make_gen():
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return TransformersWrapper(model, tokenizer=AutoTokenizer.from_pretrained(path), input_mode="history",
                                   generate=False, pad_output=True, log_probs_key="gen_log_probs")  # fmt: skip

    def make_ref():
        return make_gen().get_new_version(log_probs_key="ref_log_probs")

    first = RetrieveKL(gen_model_factory=make_gen, ref_model_factory=make_ref, use_ray_service=True,
                       actor_name="kl-service-test", add_to_reward=False, timeout_s=120)  # fmt: skip
    assert isinstance(first, RayRetrieveKL)
    second = RayRetrieveKL(actor_name="kl-service-test")  # attaches, no model needed
    assert second._actor._actor_id == first._actor._actor_id
    out = second(batch())
    assert out.get("kl_penalty").abs().max() == 0 and out.get(("ref_log_probs", "full")).shape[0] == 2
    env = ChatEnv(batch_size=(2,), system_prompt=SYSTEM).append_transform(first)
    td = env.reset(TensorDict(query=["What is 3 + 4?", "What is 10 - 2?"], batch_size=(2,)))
    td["history"].full = History.from_chats(CHATS)
    assert "kl_penalty" in env.step(td)["next"].keys()
    import ray

    ray.kill(first._actor)


def test_ray_kl_reward_transform_from_a_factory(ray_cluster, tiny_model_path, tiny_tokenizer):
    """The RayKLRewardTransform docstring's option 1 (a model factory), on CPU (num_gpus=0)."""
    path = str(tiny_model_path)

    def create_ref_model():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return TransformersWrapper(ref_model, tokenizer=AutoTokenizer.from_pretrained(path), input_mode="tokens",
                                   generate=False, return_log_probs=True, pad_output=False,
                                   log_probs_key="ref_log_probs")  # fmt: skip

    transform = KLRewardTransform(ref_model=None, ref_model_factory=create_ref_model, num_gpus=0,
                                  use_ray_service=True, actor_name="kl-reward-test", coef=0.5)  # fmt: skip
    from tensordict import lazy_stack

    from rlpost.data import Tokens
    from rlpost.envs.kl_reward import RayKLRewardTransform

    assert isinstance(transform, RayKLRewardTransform)
    ids = [torch.tensor(i) for i in rendered_ids(tiny_tokenizer, CHATS)]
    prompts = [torch.tensor(i) for i in rendered_ids(tiny_tokenizer, [chat[:-1] for chat in CHATS], True)]
    tokens = lazy_stack([Tokens(prompt=p, full=f, padded=False) for p, f in zip(prompts, ids)])
    data = TensorDict(tokens=tokens, batch_size=[2])
    data.set(("log_probs", "full"), torch.nested.as_nested_tensor([torch.full((len(i),), -1.0) for i in ids],
                                                                  layout=torch.jagged))  # fmt: skip
    data.set("next", TensorDict(reward=torch.tensor([[1.0], [0.0]]), batch_size=[2]))
    out = transform(data)["next"]
    kl_rows = list(out["kl_penalty"].unbind(0))
    assert [row.shape[0] for row in kl_rows] == [len(i) for i in ids]
    assert all(row[len(p) :].abs().sum() > 0 for row, p in zip(kl_rows, prompts))
    import ray

    ray.kill(transform._actor)
