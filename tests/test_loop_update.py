"""The update phase of grpo.trainer.train_rl on a policy small enough to follow by hand: PPO mini-batches (one
optimizer step each) over several epochs, old logprobs computed once per rollout, a loss denominator per
mini-batch, clipping; and micro-batching that leaves the step unchanged."""
from types import SimpleNamespace

import pytest
import torch

from grpo.groups import LocalRollout, Scorer
from grpo.trainer import Parts, Policy, train_rl
from launch.dist import DistInfo
from launch.recipe import load_config
from loop_harness import MemoryLog, NoCheckpoints, ScriptedEngine, sgd_policy

LETTERS = "abc"  # the vocabulary: token v is the letter LETTERS[v]


class _Ones(torch.nn.Module):
    """The 'decoder': a hidden state of 1.0 at every position, whatever the input."""

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))


class ConstantPolicy(torch.nn.Module):
    """logits = w at every position, whatever the context (hidden size 1, lm_head weight [V, 1] = w), so
    logp(y) = w_y - logsumexp(w) and d logp(y) / dw = onehot(y) - softmax(w). It has what
    models.logprobs.completion_logprobs uses of an HF model: a decoder, an output projection and a KV cache
    (nothing to cache here: the hidden state ignores the context)."""

    def __init__(self, logits):
        super().__init__()
        self.decoder = _Ones()
        self.lm_head = torch.nn.Linear(1, len(logits), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.tensor(logits)[:, None])
        self.config = SimpleNamespace(_attn_implementation="eager")  # read by models.logprobs' pass choice

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, **kwargs):
        self.decoder(input_ids)
        return SimpleNamespace(past_key_values=SimpleNamespace(batch_select_indices=lambda index: None))


def exact_match(data_source, text, ground_truth, extra_info=None):
    return float(text == ground_truth)


ROWS = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "toy", "reward_model": {"ground_truth": gt},
         "extra_info": {"index": i}} for i, gt in enumerate(["a", "cc"])]
ANSWERS = {0: ["a", "b"], 1: ["cc", "a"]}  # prompt i (the one token i) -> its G = 2 completions


def run_update(*overrides, answers=ANSWERS, optimizer_steps=None) -> tuple[torch.Tensor, list]:
    """One RL step on the constant policy from w = 0 with SGD at lr 1; returns (w after, logged metrics).
    optimizer_steps: a list that gets one entry per optimizer step taken."""
    cfg = load_config(None, ["rollout.n=2", "rollout.max_new_tokens=2", "trainer.prompts_per_step=2",
                             "trainer.steps=1", "algorithm.adv_estimator=dr_grpo", "algorithm.clip_low=0.2",
                             "algorithm.clip_high=0.2", "algorithm.agg=token-mean", "data.shuffle=false", *overrides])
    model = ConstantPolicy([0.0, 0.0, 0.0])
    engine = ScriptedEngine(lambda prompt: [([LETTERS.index(c) for c in text], text) for text in answers[prompt[0]]])
    decode = lambda ids: ["".join(LETTERS[i] for i in ids[:k]) for k in range(len(ids) + 1)]  # noqa: E731
    placeholder = torch.optim.SGD(model.parameters(), lr=0.0)
    log = MemoryLog()
    rollout = LocalRollout(cfg, engine, Scorer(exact_match, decode), DistInfo(), rows=ROWS, prompt_ids=[[0], [1]])
    parts = Parts(cfg=cfg, policy=sgd_policy(Policy(model, placeholder, None), lr=1.0), rollout=rollout, log=log,
                  checkpoints=NoCheckpoints(), pad_id=0)
    if optimizer_steps is not None:
        step = parts.policy.optimizer.step
        parts.policy.optimizer.step = lambda *args, **kwargs: (optimizer_steps.append(1), step(*args, **kwargs))[1]
    train_rl(parts, DistInfo())
    return model.lm_head.weight.detach()[:, 0].double(), log.steps


# Two mini-batches of one prompt each (ppo_mini_batch_size 1), two epochs: four SGD steps (lr 1) in the order
# e0/mb0, e0/mb1, e1/mb0, e1/mb1. Advantages (Dr. GRPO, r - group mean): prompt 0 "a" +.5, "b" -.5;
# prompt 1 "cc" +.5 on both tokens, "a" -.5. Old logprobs are those of w0 = 0 (p = 1/3 each), computed once.
# Token loss max(-A rho, -A clip(rho, .8, 1.2)), rho = p_w(y) / (1/3); gradient of -A rho in w where the
# unclipped branch is taken: -A rho (onehot(y) - p_w); the loss divides by the MINI-BATCH's tokens (2, then 3).
#  e0/mb0 at w0: rho = 1. grad = (1/2)[-.5 (e0 - p) + .5 (e1 - p)] = .25 (e1 - e0)  ->  w1 = (.25, -.25, 0).
#  e0/mb1 at w1: p = softmax(.25, -.25, 0) = (.4192290, .2542752, .3264958); rho_c = .9794875 (twice),
#        rho_a = 1.2576869 (A < 0: its clip does not bind). grad = (1/3)[2 (-.5 rho_c)(e2 - p) + .5 rho_a (e0 - p)]
#        = (.2586145, .0297200, -.2883346)  ->  w2 = (-.0086145, -.2797200, .2883346).
#  e1/mb0 at w2: p = (.3217210, .2453239, ...); rho_a = .9651631 (unclipped); rho_b = .7359717 < .8 with A < 0:
#        clipped, no gradient. grad = (1/2)(-.5 rho_a)(e0 - p) = (-.1636625, .0591944, .1044681)
#        ->  w3 = (.1550479, -.3389144, .1838665).
#  e1/mb1 at w3: p = (.3788680, ..., .3899453); rho_c = 1.1698359, rho_a = 1.1366041 (both inside the clip).
#        grad = (1/3)[2 (-.5 rho_c)(e2 - p) + .5 rho_a (e0 - p)] = (.2654013, .0463555, -.3117569)
#        ->  w4 = (-.1103534, -.3852700, .4956234).
W_AFTER = [-0.11035338806080008, -0.38526996706223116, 0.49562335512303113]


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_two_mini_batches_two_epochs_reference(micro_batch_size):
    w, steps = run_update("algorithm.ppo_mini_batch_size=1", "algorithm.ppo_epochs=2",
                          f"trainer.micro_batch_size={micro_batch_size}")
    torch.testing.assert_close(w, torch.tensor(W_AFTER, dtype=torch.float64), rtol=0, atol=1e-6)
    metrics = steps[-1][1]
    assert metrics["ratio_first_update"] == 1.0
    assert metrics["ratio_max"] == pytest.approx(1.2576869, abs=1e-6)  # e0/mb1's "a"
    # Over the 4 updates' micro-batch records: only e1/mb0's "b" is below 1 - clip_low (1 token of 2 there).
    assert metrics["clip_frac_lower"] > 0


def test_one_mini_batch_is_one_step_on_the_whole_batch():
    # ppo_mini_batch_size null, one epoch: one SGD step on all 5 tokens at w0 (rho = 1, old = current, p = 1/3):
    # grad = (1/5) sum_tokens -A (e_y - p) = (1/5)[-.5 e0 + .5 e1 - 2 (.5) e2 + .5 e0 + (sum of A) p]
    #      = (1/5)[.5 e1 - e2 + .5 p] = (1/5)(1/6, 2/3, -5/6) = (1/30, 2/15, -1/6); w = -grad.
    w, steps = run_update("trainer.micro_batch_size=1")
    torch.testing.assert_close(w, torch.tensor([-1 / 30, -2 / 15, 1 / 6], dtype=torch.float64), rtol=0, atol=1e-7)
    assert steps[-1][1]["ratio_first_update"] == 1.0


def test_a_mini_batch_of_filler_groups_takes_no_optimizer_step():
    # Dynamic sampling with one round: prompt 1's answers "a", "b" are both wrong (ground truth "cc"), so its
    # group is dropped and fills the batch with loss weight 0, last. With one prompt per mini-batch, the second
    # mini-batch has nothing to train on any rank: no step (AdamW would move the weights on momentum alone).
    steps = []
    w, logged = run_update("algorithm.ppo_mini_batch_size=1", "algorithm.ppo_epochs=2", "algorithm.dynamic_sampling=true",
                           "algorithm.max_gen_batches=1", answers={0: ["a", "b"], 1: ["a", "b"]}, optimizer_steps=steps)
    assert len(steps) == 2 and logged[-1][1]["kept_group_frac"] == 0.5
    # Both steps are prompt 0's: e0 as above (w1 = (.25, -.25, 0)); e1 at w1, old = w0: p = (.4192290,
    # .2542752, ...), rho_a = 1.2576869 > 1.2 with A > 0: clipped; rho_b = .7628256 < .8 with A < 0: clipped.
    # No gradient: w stays w1.
    torch.testing.assert_close(w, torch.tensor([0.25, -0.25, 0.0], dtype=torch.float64), rtol=0, atol=1e-7)
