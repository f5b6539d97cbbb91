"""``OrderedFold``: messages reach the server fold in sample order whatever order clients finish in."""

from __future__ import annotations

import itertools

import pytest
import torch

from driftlab.simulation.round.ordered_fold import OrderedFold
from driftlab.simulation.seam import RoundContext, ServerFold

CONTEXT = RoundContext(round=1, num_registered=10, num_selected=4, server_learning_rate=1.0)


def _recording_fold(seen: list) -> ServerFold:
    """A fold whose result is the order it saw the messages in and their float sum in that order."""

    def add(accumulator, message):
        seen.append(message)
        return accumulator + message

    return ServerFold(
        lambda server, context: torch.zeros(()),
        add,
        lambda server, total, context: (server + total, {"sum": float(total)}),
    )


@pytest.mark.parametrize("completion", list(itertools.permutations(range(4))))
def test_messages_are_folded_in_sample_order_for_every_completion_order(completion):
    order = [7, 2, 9, 4]  # sample order (client ids)
    messages = {7: torch.tensor(1e8), 2: torch.tensor(1.0), 9: torch.tensor(-1e8), 4: torch.tensor(1.0)}
    seen: list = []
    folding = OrderedFold(_recording_fold(seen), torch.tensor(0.0), CONTEXT, order)
    for index in completion:
        folding.add(order[index], messages[order[index]])
    result = folding.result()
    assert [float(m) for m in seen] == [1e8, 1.0, -1e8, 1.0]
    assert result.reporting_clients == order
    assert float(result.server) == float(((torch.tensor(1e8) + 1.0) - 1e8) + 1.0)  # float32: the order changes the sum


def test_a_message_waits_only_for_the_clients_before_it():
    seen: list = []
    folding = OrderedFold(_recording_fold(seen), torch.tensor(0.0), CONTEXT, [1, 2, 3])
    folding.add(2, torch.tensor(2.0))
    assert seen == []  # client 1 has not finished
    folding.add(1, torch.tensor(1.0))
    assert [float(m) for m in seen] == [1.0, 2.0]  # both folded, nothing kept


def test_clients_that_send_nothing_or_never_finish_are_skipped():
    seen: list = []
    folding = OrderedFold(_recording_fold(seen), torch.tensor(5.0), CONTEXT, [1, 2, 3, 4])
    folding.add(4, torch.tensor(4.0))
    folding.add(1, None)  # finished, sent nothing
    folding.add(3, torch.tensor(3.0))
    result = folding.result()  # client 2 never finished (a deployment's lost node)
    assert result.reporting_clients == [3, 4] and float(result.server) == 12.0
    assert result.upload_bits == 2 * 32  # one float32 each


def test_a_round_without_messages_keeps_the_server_state():
    folding = OrderedFold(_recording_fold([]), torch.tensor(5.0), CONTEXT, [1, 2])
    folding.add(1, None)
    result = folding.result()
    assert float(result.server) == 5.0 and result.metrics == {} and result.reporting_clients == []


def test_reporting_models_are_averaged_in_sample_order():
    folding = OrderedFold(_recording_fold([]), torch.tensor(0.0), CONTEXT, [1, 2, 3], keep_models=True)
    folding.add(3, torch.tensor(0.0), torch.tensor([3.0, 0.0]))
    folding.add(2, None, torch.tensor([100.0, 100.0]))  # sent nothing: not in the mean
    folding.add(1, torch.tensor(0.0), torch.tensor([1.0, 2.0]))
    assert torch.equal(folding.result().reporting_mean, torch.tensor([2.0, 1.0]))


def test_unknown_and_repeated_clients_are_refused():
    folding = OrderedFold(_recording_fold([]), torch.tensor(0.0), CONTEXT, [1, 2])
    with pytest.raises(ValueError, match="client 5 is not one of the round's active clients"):
        folding.add(5, torch.tensor(1.0))
    folding.add(2, torch.tensor(1.0))
    with pytest.raises(ValueError, match="client 2 finished twice"):
        folding.add(2, torch.tensor(1.0))
    folding.add(1, torch.tensor(1.0))
    with pytest.raises(ValueError, match="client 1 finished twice"):
        folding.add(1, torch.tensor(1.0))


def _counting_fold(finishes_empty: bool, finished: list) -> ServerFold:
    """A fold that counts the messages it took and records every finish (the count it saw)."""

    def finish(server, count, context):
        finished.append(count)
        return server + 100.0, {"messages": float(count)}

    return ServerFold(
        lambda server, context: 0, lambda count, message: count + 1, finish, finishes_empty=finishes_empty
    )


@pytest.mark.parametrize("order", [[], [1, 2]], ids=["nobody selected", "nobody sent anything"])
def test_an_empty_round_is_finished_only_by_a_fold_that_finishes_empty(order):
    for finishes_empty in (True, False):
        finished: list = []
        folding = OrderedFold(_counting_fold(finishes_empty, finished), torch.tensor(5.0), CONTEXT, order)
        for client_id in order:
            folding.add(client_id, None)
        result = folding.result()
        assert result.reporting_clients == [] and result.upload_bits == 0 and result.reporting_mean is None
        if finishes_empty:  # finish ran on the empty accumulator: its state and metrics are the round's
            assert finished == [0] and float(result.server) == 105.0 and result.metrics == {"messages": 0.0}
        else:  # finish never ran: the state stays and there are no metrics
            assert finished == [] and float(result.server) == 5.0 and result.metrics == {}


def test_a_fold_that_finishes_empty_finishes_a_round_with_messages_once():
    finished: list = []
    folding = OrderedFold(_counting_fold(True, finished), torch.tensor(5.0), CONTEXT, [1, 2, 3], keep_models=True)
    folding.add(2, torch.tensor(1.0), torch.tensor([4.0]))
    folding.add(1, None, torch.tensor([9.0]))
    result = folding.result()
    assert finished == [1] and result.metrics == {"messages": 1.0} and result.reporting_clients == [2]
    assert torch.equal(result.reporting_mean, torch.tensor([4.0]))
