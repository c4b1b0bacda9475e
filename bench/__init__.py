"""fastqwen's measurement harness: `python -m bench ENTRY [options] --out FILE.json` (see __main__.py)."""
