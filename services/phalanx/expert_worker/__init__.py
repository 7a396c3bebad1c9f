"""The expert worker of a disaggregated MoE deployment: a stateless process that computes the experts the ERT gives it.

Attention workers send it a layer's activations over a tensor channel (`wire`); it batches them across attention
workers (`batcher`) and returns the expert outputs. Its entry point is `process.ExpertWorkerProcess`
(`phalanx expert-worker`).
"""
