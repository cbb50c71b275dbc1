"""The pure core: the records and their grammar (arms, traces, digests, classification, proofs, verdicts),
query points, prompts, the manifest and catalog, observation profiles and episode protocols; the configuration
(`core/configuration/`) and the figures (`core/figures/`) are rooms of their own. No I/O beyond reading a named
file; no simulator, network or clock. Every other floor may import it; it imports none of them."""
