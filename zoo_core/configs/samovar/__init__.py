"""SAMoVAR configs: the synthetic VAR experiment (Fig. 4), real-data forecasting (embedded and ETT CSVs)."""
