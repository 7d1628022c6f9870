"""Loader budgets: the CPUs a process may use, its loader memory plan, and the sizing that joins them."""
