"""What the tests share: fakes, servers, helpers and strategies (no tests here)."""
