"""Val loss/bpb and HellaSwag are two instances of one task shape (gptrain/evals/task.py): built
once, `run(model, info, autocast)` returns an Outcome whose metrics are what each scorer computes
on its own, so the training loop and `gptrain eval` can run any task the same way."""

from contextlib import nullcontext

import pytest
import torch
from test_hellaswag import CPU, HELLASWAG

from gptrain.data.loader import Dataset
from gptrain.data.tokenizers import load_tokenizer
from gptrain.evals import hellaswag as hs
from gptrain.evals.task import Outcome
from gptrain.evals.val import ValLoss, evaluate
from gptrain.model.gpt import GPT, GPTConfig


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=257, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()


@pytest.mark.skipif(not HELLASWAG.is_file(), reason=f"HellaSwag test data not found at {HELLASWAG}")
def test_both_tasks_have_the_shape_and_report_their_scorers_numbers(byte_data):
    m, tok = model(), load_tokenizer("byte")
    dataset = Dataset(byte_data)
    lengths = torch.as_tensor(tok.token_byte_lengths())
    val = ValLoss(dataset, seq_len=64, micro_batch_size=4, eval_tokens=2048, byte_lengths=lengths)
    swag = hs.HellaSwag(hs.load_examples(str(HELLASWAG), 8), tok, 64, batch_tokens=1024)
    outcomes = {task.name: task.run(m, CPU, nullcontext()) for task in (val, swag)}
    assert set(outcomes) == {"val", "hellaswag"}
    assert all(isinstance(o, Outcome) and o.line for o in outcomes.values())

    loss, bpb = evaluate(m, dataset, seq_len=64, micro_batch_size=4, eval_tokens=2048, info=CPU, autocast=nullcontext(), byte_lengths=lengths)  # fmt: skip
    assert outcomes["val"].metrics == {"val_loss": loss, "val_bpb": bpb}
    assert f"val loss {loss:.4f}" in outcomes["val"].line

    result = swag.score(m, CPU, nullcontext())
    assert outcomes["hellaswag"].metrics == result.metrics()  # what the loop logs: acc, acc_norm
    details = outcomes["hellaswag"].details
    assert details["hellaswag_examples"] == 8
    assert details["hellaswag_predictions"]["acc_norm"] == result.pred_norm.tolist()
