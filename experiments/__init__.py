"""The paper's reproduction: Tables 1-3 (`make table1`, `table2`, `table3` and their `-cpu` runs), the
quality sweep built on Table 3's protocol (`make quality-cpu`), and the dated studies (studies/)."""
