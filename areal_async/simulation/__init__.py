"""Simulated hardware: profiles of modelled engines and trainers (`profile.py`)."""
