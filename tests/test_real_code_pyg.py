"""PyTorch Geometric's training loops through ``functacc.jit``, against eager.

Node classification as PyG's README writes it (``GCNConv`` twice, dropout, the loss on
``out[train_mask]``) and with ``GATConv``/``SAGEConv``; graph classification over a PyG
``DataLoader``, whose ``Batch`` is the step's argument (``model(data.x, data.edge_index,
data.batch)``, ``global_mean_pool``), on random graphs. Before 2026-11-28 a ``Batch``
argument was a constant of the trace (neither a tensor nor a number); it is now followed
as an object the body reads, its tensors fed every call. ``global_mean_pool`` without its
``size`` reads ``int(batch.max()) + 1`` on the host: a ``TraceError`` naming PyG's function
and the ``size=`` that fixes it (which then runs as eager). With ``backend="eager"`` losses
and weights are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GATConv, GCNConv, SAGEConv, global_mean_pool

import functacc


class NodeClassifier(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "gcn":
            self.conv1, self.conv2 = GCNConv(16, 32), GCNConv(32, 3)
        else:
            self.conv1, self.conv2 = GATConv(16, 8, heads=4), SAGEConv(32, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, edge_index)


def node_run(kind: str, jit: bool) -> tuple[list, torch.nn.Module]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, edge_index = torch.randn(50, 16, generator=g), torch.randint(0, 50, (2, 200), generator=g)
    y, train_mask = torch.randint(0, 3, (50,), generator=g), torch.rand(50, generator=g) < 0.5
    model = NodeClassifier(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    def train(x, edge_index, y, train_mask):
        model.train()
        opt.zero_grad()
        out = model(x, edge_index)
        loss = F.cross_entropy(out[train_mask], y[train_mask])
        loss.backward()
        opt.step()
        return float(loss)

    if jit:
        train = functacc.jit(train, modules=model, optimizers=opt, backend="eager")
    torch.manual_seed(2)  # the dropout masks
    return [train(x, edge_index, y, train_mask) for _ in range(4)], model


@pytest.mark.parametrize("kind", ["gcn", "gat_sage"])
def test_node_classification_as_pygs_readme_writes_it_runs_as_in_eager(kind: str) -> None:
    (got, model), (expected, reference) = node_run(kind, True), node_run(kind, False)
    assert got == expected
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


class GraphClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lin = GCNConv(8, 16), torch.nn.Linear(16, 2)

    def forward(self, x, edge_index, batch, size=None):
        return self.lin(global_mean_pool(F.relu(self.conv(x, edge_index)), batch, size=size))


def graph_run(jit: bool, sized: bool = True) -> tuple[list, torch.nn.Module]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    graphs = []
    for i in range(12):
        n = 5 + i % 4
        edges = torch.randint(0, n, (2, 3 * n), generator=g)
        x, y = torch.randn(n, 8, generator=g), torch.randint(0, 2, (1,), generator=g)
        graphs.append(Data(x=x, edge_index=edges, y=y))
    model = GraphClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def train(data):
        opt.zero_grad()
        size = data.num_graphs if sized else None
        out = model(data.x, data.edge_index, data.batch, size)
        loss = F.cross_entropy(out, data.y)
        loss.backward()
        opt.step()
        return float(loss) * data.num_graphs

    if jit:
        train = functacc.jit(train, modules=model, optimizers=opt, backend="eager")
    loader = DataLoader(graphs, batch_size=4, shuffle=False)
    return [train(data) for _ in range(2) for data in loader], model


def test_graph_classification_over_pygs_batches_runs_as_in_eager() -> None:
    (got, model), (expected, reference) = graph_run(True), graph_run(False)
    assert got == expected and len(got) == 6
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    advice = r"(?s)global_mean_pool\(\).*size=data.num_graphs"
    with pytest.raises(functacc.TraceError, match=advice):
        graph_run(True, sized=False)
