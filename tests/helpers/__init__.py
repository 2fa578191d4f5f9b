"""Code the tests share: servers, fake workers, tiny policies and the builders of their inputs (no tests here)."""
