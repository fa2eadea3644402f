"""The compiler: passes from a logical Job to a physical Plan (one module per pass, one entry point each)."""
