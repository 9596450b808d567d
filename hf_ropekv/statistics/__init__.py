"""Query statistics for the RoPE scorer: calibrated, online, fingerprinted."""
