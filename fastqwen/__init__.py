"""fastqwen: the tools around the engine (checkpoint synthesis, the judge, packaging)."""

__version__ = "0.1.0"
