"""Agents: AtnAgent (one per attention device) and FfnAgent (one per FFN device)."""
