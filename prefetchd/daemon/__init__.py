"""The producer: sources, sampler, decode/augment, writer, flow control, CLI."""
