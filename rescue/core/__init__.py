"""The pure core: query points, digests, classification, statistics, proofs, prompts, the
manifest and catalog, observation profiles, the configuration. No I/O beyond reading a named
file; no simulator, network or clock. Every other floor may import it; it imports none of them."""
