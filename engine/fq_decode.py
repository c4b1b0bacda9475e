"""The decode loop's one owner of CUDA graphs.

A `DecodeRunner` holds the static input buffers of the decode step (tokens,
positions, lengths) for one batch size and cache capacity, and, on a GPU, the
CUDA graph of one whole step captured over them. A step reads its token and
position from device memory and writes the next ones back, so replays chain
with no host involvement; the host only copies each step's tokens out.

Rule: one graph per (batch, cache capacity), captured before the prefill of the
first generate of that shape (the warmup), never per sample. A call whose batch
matches and whose length fits reuses it.
"""
import torch


class DecodeRunner:
    def __init__(self, model, batch: int, use_graph: bool):
        dev = model.device
        self.model = model
        self.batch = batch
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.lengths = torch.ones(batch, dtype=torch.int32, device=dev)
        self.graph = None
        if use_graph:
            self._capture()

    def _step(self) -> None:
        nxt = self.model.decode(self.tokens, self.positions, self.lengths)
        self.tokens.copy_(nxt)
        self.positions.add_(1)
        self.lengths.add_(1)

    def _capture(self) -> None:
        # Warm up on a side stream first: Triton compiles, cuBLAS picks its
        # kernels and every cached workspace is allocated outside the graph's
        # pool. The K/V these steps write at positions 0-1 is garbage that the
        # prefill which follows overwrites.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        torch.cuda.synchronize()
        self.graph = graph

    def start(self, first_tokens: torch.Tensor, position: int) -> None:
        """Point the step at the token after the prompt: position = prompt length."""
        self.tokens.copy_(first_tokens)
        self.positions.fill_(position)
        self.lengths.fill_(position + 1)

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
