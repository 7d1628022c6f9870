"""`python -m bench gpu`: every GPU path of the template, checked and timed."""
