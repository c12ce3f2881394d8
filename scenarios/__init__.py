"""The DT-FM paper's five network scenarios, as data."""
